"""mkdocs hook: the benchmark plots live in benchmarks/ (next to the results they plot), not in
docs/; the pages show them as benchmarks/..., so the site gets them at that path."""
from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    root = Path(config["docs_dir"]).resolve().parent
    for image in sorted((root / "benchmarks").rglob("*.png")):
        files.append(File(str(image.relative_to(root)), str(root), config["site_dir"],
                          config["use_directory_urls"]))
    return files
