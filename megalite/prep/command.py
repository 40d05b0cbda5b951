"""`megalite prepare-data`: raw files into a prepared directory, or what a run's data section
lacks (raw paths into data.cache_dir, shard facts) into its cache, ahead of the run or started
by it (data/prepared.data_for_run: the run's ranks only read).
"""
import argparse
import json
import os
import sys
from pathlib import Path

from megalite.command_args import command_parser
from megalite.data.prepared import (MissingFacts, NotPrepared, PreparedData, RawBuild,
                                    check_eos_token, load_data)
from megalite.data.raw_files import expand_inputs
from megalite.data.record_counts import skipped_records
from megalite.failures import ERROR_PREFIX
from megalite.prep.facts import write_missing_facts
from megalite.prep.raw_cache import build_raw
from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.run_config import DataConfig, load_config
from megalite.typed_config import ConfigError, from_dict


def prepare_for_run(cfg: DataConfig, in_run: bool = True,
                    tokenizer_from: str = "data.tokenizer") -> PreparedData:
    """`cfg`'s data, every part it lacks prepared (in_run False: raw data of any size)."""
    tries: dict[str, int] = {}
    while True:
        try:
            return load_data(cfg, in_run=in_run, tokenizer_from=tokenizer_from)
        except NotPrepared as part:
            what = part.name()
            tries[what] = tries.get(what, 0) + 1
            if tries[what] > 3:  # prepared, yet still missing (rewritten meanwhile?): never loop
                raise ConfigError(f"data: {what} is still not prepared after 3 preparations: is "
                                  f"something rewriting it while the run starts?")
            if isinstance(part, RawBuild):
                build_raw(part, cfg)
            elif isinstance(part, MissingFacts):
                write_missing_facts(part.shards, cfg.cache_dir, part.max_id, part.longer_than)


def main(argv: list[str]) -> int:
    """`megalite prepare-data --input PATH... --out DIR [--tokenizer tok.json] [--workers N]`, or
    `megalite prepare-data --config CFG [data.key=value ...]` to fill a run's cache ahead of it."""
    parser = command_parser("megalite prepare-data", main.__doc__)
    parser.add_argument("--input", nargs="+", help="files, directories or globs (quote them)")
    parser.add_argument("--out", help="the prepared directory (a re-run finishes what is missing)")
    parser.add_argument("--tokenizer", help="a tokenizer.json or a Hugging Face tokenizer "
                        "directory; without it a byte-level BPE is trained")
    parser.add_argument("--eos-token", help="the token that ends a document, where the "
                        "tokenizer's files do not name it")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizing processes, 0: in this process (default: the CPU count, "
                             "here %(default)s)")
    parser.add_argument("--text-key", default="text", help="the JSON field or parquet column of the text")
    parser.add_argument("--strict", action="store_true", help="a bad record is an error, not counted")
    parser.add_argument("--chat-template", help="conversations (jsonl or parquet `messages`, or `prompt` and "
                        "`completion`) rendered with this template: auto (the tokenizer's own), the "
                        "template, or a .jinja file")
    parser.add_argument("--train-on", choices=("assistant", "last", "all"), default="assistant",
                        help="which tokens of a conversation are targets")
    parser.add_argument("--bpe-vocab-size", type=int, default=4096, help="tokens of the trained BPE")
    parser.add_argument("--bpe-sample-mb", type=float, default=100.0,
                        help="MB of documents the BPE is trained on")
    parser.add_argument("--dtype", choices=("auto", "uint16", "int32"), default="auto",
                        help="token ids on disk (auto: uint16 while the vocabulary fits)")
    parser.add_argument("--shard-size-gb", type=float, default=0.0,
                        help="merge consecutive input files into shards of about this many GB of "
                             "tokens, each closed after the file that reaches it (a larger file "
                             "is a shard of its own); 0: one shard per input file")
    parser.add_argument("--config", help="a run config: prepare its data into data.cache_dir")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of --config, e.g. data.seq_len=512")
    parser.add_argument("--for-run", help=argparse.SUPPRESS)  # a run's data section (data_for_run)
    args = parser.parse_args(argv)
    if args.for_run:
        given = json.loads(args.for_run)
        try:
            prepare_for_run(from_dict(DataConfig, given["data"], "data."),
                            tokenizer_from=given["tokenizer_from"])
        except ConfigError as err:  # the run's rank reports it (not report_error: not a rank)
            print(f"{ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
            return 2
        return 0
    if args.input:
        if not args.out:
            raise ConfigError("--input needs --out DIR: where the prepared shards go")
        if args.workers < 0:
            raise ConfigError(f"--workers {args.workers} must be >= 0 (0: tokenize in this process)")
        check_eos_token(args.tokenizer, args.eos_token)
        meta = prepare_directory(expand_inputs(args.input), Path(args.out), PrepareSettings.named_in(args))
        print(json.dumps({k: v for k, v in meta.items() if k != "shards"}, indent=1))
        if skipped := skipped_records(meta, f"{args.out}/meta.json"):
            print(f"prepare-data: {skipped}", file=sys.stderr)
        return 0
    data = prepare_for_run(load_config(args.config, args.overrides).data, in_run=False)
    print(json.dumps(data.meta, indent=1))
    return 0
