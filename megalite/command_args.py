"""Every command's parser (command_parser), and those of the commands whose modules import
torch, in a module that does not: `megalite <command> --help` and bad arguments are answered
before the command's module loads (torch alone takes seconds to import on a busy machine).
Each such command parses its argv with the parser made here; megalite/cli.py parses it first,
before the import."""
import argparse
import ast
import importlib.util
from pathlib import Path

# The commands that compute (cli.COMPUTING): their help says with how many threads.
THREADS = """torch's CPU threads: OMP_NUM_THREADS where it is set (torchrun sets 1 per rank), else
the cores this process may use less the 1-minute load average (other processes' work), at least 1."""
CKPT = "a checkpoint: RUN_DIR/checkpoints/step_NNNNNNNN"
TRAIN_ON = ("assistant", "last", "all")  # data/chat.py's, which imports the tokenizers


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (module docstrings are wrapped already), and the default of
    every option that has one (not None, False or empty) after its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text, default = action.help or "", action.default
        if ("%(default)" not in help_text and default not in (None, argparse.SUPPRESS)
                and default is not False and default != []):
            help_text += " (default: %(default)s)"
        return help_text


def command_parser(prog: str, description: str | None = None,
                   epilog: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser: `megalite <command> --help` shows its defaults."""
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                   formatter_class=HelpFormatter)


def module_doc(module: str) -> str | None:
    """A module's docstring, read from its source: importing the module would import torch."""
    source = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
    return ast.get_docstring(ast.parse(source), clean=False)


# Not capped by the load: a run's numbers would then depend on it (a resume is bit-exact only
# on the threads it started with).
TRAIN_THREADS = """torch's CPU threads: OMP_NUM_THREADS where it is set (torchrun sets 1 per rank), else
torch's default, every core: on a busy machine set OMP_NUM_THREADS (the same for a resume)."""


def train_parser() -> argparse.ArgumentParser:
    parser = command_parser("megalite train", module_doc("megalite.train"), TRAIN_THREADS)
    parser.add_argument("--config", help="YAML run config (see configs/demo.yaml); without it, "
                                         "the defaults of docs/config.md")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2")
    return parser


def export_parser() -> argparse.ArgumentParser:
    parser = command_parser("megalite export", "Write a checkpoint as a Hugging Face model directory.",
                            THREADS)
    parser.add_argument("--ckpt", required=True, help=CKPT)
    parser.add_argument("--to-hf", required=True, dest="out",
                        help="the directory to write (made if missing; in an earlier export's, "
                             "the model's files are replaced and any others kept)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",  # hf/convert.DTYPES
                        help="the weights' type in the files")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="largest safetensors file, in GB of 10**9 bytes")
    return parser


def import_parser() -> argparse.ArgumentParser:
    parser = command_parser("megalite import", "Make a megalite checkpoint (step 0, no optimizer "
                                               "state) of a Hugging Face model directory.", THREADS)
    parser.add_argument("--from-hf", required=True, dest="hf_dir",
                        help="a Hugging Face model directory: config.json, safetensors, tokenizer.json")
    parser.add_argument("--to", required=True, dest="ckpt", help="the checkpoint directory to write")
    parser.add_argument("--eos-token", help="the token that ends a document, where the "
                        "tokenizer's files do not name it")
    return parser


def eval_parser() -> argparse.ArgumentParser:
    parser = command_parser("megalite eval", module_doc("megalite.evaluate"), THREADS)
    parser.add_argument("--ckpt", required=True, help=CKPT)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="a UTF-8 text file")
    what.add_argument("--chat", help="a jsonl of conversations (messages, or prompt and "
                                     "completion): the loss over their target tokens")
    parser.add_argument("--chat-template", help="--chat's template, or a .jinja file (default: "
                                                "the checkpoint tokenizer's own)")
    parser.add_argument("--train-on", choices=TRAIN_ON, default="assistant",
                        help="--chat: which tokens are predicted (default: the assistant's turns)")
    add_layout_arguments(parser, cp=True)
    parser.add_argument("--json", action="store_true", help='print {"loss", "ppl", "tokens"}')
    return parser


def generate_parser() -> argparse.ArgumentParser:
    parser = command_parser("megalite generate", module_doc("megalite.generate"), THREADS)
    parser.add_argument("--ckpt", required=True, help=CKPT)
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a prompt; repeat for a batch of several")
    given.add_argument("--chat", action="append",
                       help="a conversation (JSON) for the model to answer; repeat for several")
    parser.add_argument("--chat-template", help="--chat's template, or a .jinja file (default: "
                                                "the checkpoint tokenizer's own)")
    add_layout_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens added to each prompt")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the most likely token each time); above 0: sampling")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens of this total probability")
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    return parser


def add_layout_arguments(parser: argparse.ArgumentParser, cp: bool = False) -> None:
    """eval's and generate's layout (inference.layout_of reads them)."""
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (under torchrun; DP over the others)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--pp-layers", type=layer_counts, default=None,
                        help="layers per stage, e.g. 3,2 (parallel.pp_layers): stages that "
                             "model.n_layers does not divide evenly")
    if cp:
        parser.add_argument("--cp", type=int, default=1,
                            help="context-parallel ranks: each window split over them")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks (a mixture of experts): each MoE layer's "
                             "experts split over them, out of the DP x CP ranks")


def layer_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not layer counts separated by commas, "
                                         f"e.g. 3,2") from None


def slurm_parser() -> argparse.ArgumentParser:
    parser = command_parser("megalite slurm", module_doc("megalite.launch.slurm"))
    parser.add_argument("sweep", help="a sweep YAML (see configs/sweeps/)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true",
                      help="print the script and the runs; write nothing")
    mode.add_argument("--submit", action="store_true", help="sbatch the array")
    return parser


def sweep_status_parser() -> argparse.ArgumentParser:
    parser = command_parser("megalite sweep-status", "Each run of a submitted sweep: its state, "
                                                     "last step, loss and tokens/s.")
    parser.add_argument("sweep_dir", help="the sweep's directory, RUN_ROOT/<sweep>")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    return parser


# By command name (cli.COMMANDS). Not here: prepare-data parses before it imports torch,
# and torchrun's parser is torch's own (torch.distributed.run, which imports torch).
PARSERS = {"train": train_parser, "export": export_parser, "import": import_parser,
           "eval": eval_parser, "generate": generate_parser, "slurm": slurm_parser,
           "sweep-status": sweep_status_parser}
