"""Train a model: `python -m megalite.train --config CFG [key=value ...]`, under torchrun or alone.

Every check that can fail on bad input (the config, the data, the batch arithmetic) runs before
the process group exists, on every rank, so a bad run stops everywhere with one message instead
of leaving ranks waiting in a collective.
"""
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from megalite.command_args import train_parser
from megalite.data.batches import SAMPLE_ORDER, Batch, BatchOrder, Prefetcher
from megalite.data.chat import generation_prompt, load_chat_template
from megalite.data.prepared import PreparedData
from megalite.data.record_counts import skipped_records
from megalite.generate import sampled
from megalite.hf.convert import load_pretrained, pretrained_model
from megalite.parallel.mappings import all_reduce_over
from megalite.parallel.random import restore_run_rng, run_rng_state
from megalite.parallel.state import ParallelState, init_parallel
from megalite.pipeline.objective import objective_of
from megalite.progress import Progress
from megalite.run_config import Config, given_keys, load_config, to_dict
from megalite.training.checkpoint import CheckpointWriter, layout_of, load_checkpoint, read_optimizer_state
from megalite.training.build import build_engine, build_model
from megalite.training.engine import autocast_for, train_step
from megalite.training.evaluation import all_reduce_loss, eval_plan, evaluate
from megalite.training.host_memory import map_large_blocks
from megalite.training.metrics import (MetricsLog, flops_per_token, moe_metrics, peak_flops,
                                       peak_memory_bytes, plot_losses, start_wandb)
from megalite.training.optim import describe_schedule, lr_at
from megalite.training.optimizers.build import describe_optimizers
from megalite.training.peers import Peers
from megalite.training.preemption import (PREEMPTED, StopRequest, clear_marker, mark_preempted,
                                          the_stop_is_saved)
from megalite.training.profiling import StepProfiler
from megalite.training.snapshots import Snapshots, snapshot_dir
from megalite.training.watchdog import Watchdog
from megalite.plan import Plan, plan_run, sample_sets
from megalite.run_setup import run_identity


def main(argv: list[str] | None = None) -> int:
    args = train_parser().parse_args(argv)  # None: sys.argv[1:]
    cfg = load_config(args.config, args.overrides, pretrained_model)
    if not torch.cuda.is_available():
        map_large_blocks()  # else freed tensors' heap holes stay resident (host_memory.py)
    plan = plan_run(cfg, given_keys(args.config, args.overrides), int(os.environ.get("WORLD_SIZE", "1")),
                    launched="WORLD_SIZE" in os.environ)
    with StopRequest() as stop:
        pstate = init_parallel(plan.cfg.parallel)
        try:
            peers = Peers(pstate)
            try:
                train(plan, pstate, stop, peers)
            except RuntimeError as err:  # a failed collective: a dead peer is named
                lost = peers.lost(err)
                if lost is None:
                    raise
                raise lost from err
        except Preempted:
            return PREEMPTED
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def train(plan: Plan, ps: ParallelState, stop: StopRequest, peers: Peers) -> None:
    cfg, data, train_set, resume_from = plan.cfg, plan.data, plan.train_set, plan.resume_from
    run_dir, t = Path(cfg.run.dir), cfg.train
    model = build_model(cfg, ps, init=resume_from is None and not t.init_from)
    saved = resume(resume_from, model, ps, cfg)
    if resume_from is None and t.init_from:
        load_pretrained(Path(t.init_from), model, ps)
    # After the weights: DeepSpeed copies them into its fp32 partitions.
    engine = build_engine(model, t, ps, cfg.parallel)
    if resume_from is not None and t.load_optimizer:
        engine.load_optimizer_state(read_optimizer_state(resume_from, model, engine.held_rows,
                                                         engine.states), saved["step"])
    snapshots = None
    if t.snapshot_every:
        snapshots = Snapshots(snapshot_dir(t.snapshot_dir, run_dir), ps,
                              {**run_identity(cfg, data), "layout": layout_of(ps)})
        if t.resume != "auto":  # from the step named: the later snapshots are not this run's
            snapshots.drop_after(saved["step"])
        else:  # a snapshot newer than the checkpoint: its step and counters
            saved = snapshots.restore_newest(saved["step"], model, engine) or saved
    start = saved["step"]
    if start >= t.max_steps:
        if ps.is_main:
            print(f"nothing to do: the checkpoint is at step {start}, train.max_steps={t.max_steps}")
        return
    val_set = sample_sets(data.val, cfg, data).nonempty()
    metrics = open_run(cfg, ps, data, start, model, val_set)
    objective = objective_of(t.objective)
    order = BatchOrder(train_set.sizes, train_set.weights, t.global_batch_size, cfg.run.seed,
                       objective.group_rows)
    autocast = autocast_for(ps.device, t.precision)
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops(ps.device)
    # Rank 0's: a bar on a terminal, a line per logged step in a log file.
    bar = Progress(t.max_steps, lambda step: f"step {step}/{t.max_steps}", enabled=ps.is_main,
                   initial=start, desc="train")
    # Nothing in a dense model's step waits for the device but the logging steps' .item() (an
    # MoE layer waits for its token counts, which size its all-to-alls): the token counts
    # stay on the device and the stop agreement lags a step, so the host queues step N+1
    # while the device still runs step N. Step N+1's batches are collated (and pinned) in a
    # thread meanwhile, and checkpoints are written to disk in another.
    counted = TokenCount(saved, len(data.train), ps.device)
    logged_at = start

    def host_batches(step: int) -> list[Batch]:
        batches = [train_set.collate(r)
                   for r in order.micro_batches(step, ps.dp_rank, ps.dp_size, t.micro_batch_size)]
        return [b.pinned() for b in batches] if ps.device.type == "cuda" else batches

    watchdog = Watchdog(t.watchdog_s, run_dir, ps.rank, peers.table, peers.host) if t.watchdog_s else None
    with (CheckpointWriter(ps) as writer, Prefetcher(host_batches, range(start, t.max_steps)) as steps,
          StepProfiler(t.profile_steps, run_dir, ps.rank, ps.device) as profiler, watchdog or nullcontext()):
        def save(step: int) -> None:
            """Start saving step `step` (written in the background: see CheckpointWriter)."""
            meta = {"layout": layout_of(ps), "config": to_dict(cfg), **counted.counters(),
                    "data_content": data.meta["content"], "sample_order": SAMPLE_ORDER}
            writer.save(run_dir, step, model, engine, run_rng_state(model.rng), meta, t.keep_checkpoints,
                        tokenizer=data.tokenizer)

        def finish() -> None:
            writer.finish()  # complete on every rank: the next start resumes from it
            if snapshots is not None:  # the checkpoint holds it all
                snapshots.clear()

        for step, batches in steps:
            done = step + 1
            peers.step = done
            lr = lr_at(step, t)
            engine.set_lr(lr)
            batches = [b.to(ps.device) for b in batches]
            # Counted on the device: a tensor made from a host number would wait for it.
            n_tokens = counted.add(all_reduce_over(sum(b.target_count_per_source(len(data.train))
                                                       for b in batches), ps.dp_group))
            model.train()
            with profiler.step(done):
                loss, grad_norm = train_step(engine, batches, n_tokens, autocast, cfg.parallel.pp_schedule,
                                             objective)

            last = done == t.max_steps
            logged = done % t.log_every == 0 or last
            if logged:
                loss_value = all_reduce_loss(loss, ps).item()  # waits for the device
                # Throughput since the last log: the real tokens trained on (padding excluded),
                # all ranks together; MFU divides it by the peak of all devices.
                tokens_per_s = counted.rate()
                mfu = tokens_per_s * flops / (ps.world_size * peak) if peak else None
                memory = peak_memory_bytes(ps) / 2**30
                record = {"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                          "tokens": int(counted.total.item()), **counted.by_source(data),
                          "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_memory_gib": memory,
                          "time": time.time(), **moe_metrics(model, ps, done - logged_at)}
                logged_at = done
                if metrics:
                    metrics.write(record)
                bar.show(done, f"loss {loss_value:.4f}, lr {lr:.2e}, tok/s {tokens_per_s:,.0f}, "
                               f"mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'}, mem {memory:.2f} GiB")
            evaluated = t.eval_every and done % t.eval_every == 0 and not last
            if evaluated:
                with bar.aside():  # the validation line on a line of its own
                    evaluate(cfg, model, val_set, ps, done, metrics, autocast)
            checkpointed = t.checkpoint_every and done % t.checkpoint_every == 0 and not last
            if checkpointed:
                save(done)
            if snapshots is not None and done % t.snapshot_every == 0 and not last:
                cost = snapshots.save(done, model, engine, run_rng_state(model.rng), counted.counters())
                if ps.is_main and done == t.snapshot_every * (start // t.snapshot_every + 1):
                    with bar.aside():  # the first of this start: what each costs
                        print(cost, flush=True)
            if logged or evaluated or checkpointed:  # a new interval; evaluating or saving is not training
                counted.restart()
            if watchdog is not None:
                watchdog.beat(done)
            if not last and stop.agreed(ps):
                if not checkpointed:
                    save(done)
                finish()  # the requeued run resumes from it
                if ps.is_main:
                    bar.close()
                    print(mark_preempted(run_dir, done, stop.signal_name or "another rank's signal"),
                          flush=True)
                the_stop_is_saved(stop, ps.rank)
                raise Preempted()
        bar.close()
        if watchdog is not None:  # the last save, evaluation and samples may take longer
            watchdog.disarm()
        save(t.max_steps)
        # Written while the model is evaluated and sampled.
        evaluate(cfg, model, val_set, ps, t.max_steps, metrics, autocast)
        samples(cfg, model, data, ps, run_dir)
        finish()
    if ps.is_main:
        plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png")
        if metrics.wandb_run is not None:
            metrics.wandb_run.finish()


def open_run(cfg: Config, ps: ParallelState, data: PreparedData, start: int, model,
             val_set) -> MetricsLog | None:
    """Rank 0 readies run.dir for the steps after `start`: its config.yaml, no preemption
    marker, the data, the lr schedule, (Muon) the optimizers and the evaluation announced, and
    the metrics log (and wandb run) the steps append to; None on the other ranks."""
    if not ps.is_main:
        return None
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_marker(run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    report_data(data)
    # At every start: a decay kept from a checkpoint, or copied in a config.yaml, shows.
    if cfg.train.epochs:
        print(f"steps: {cfg.train.max_steps} of {cfg.train.global_batch_size} samples for "
              f"train.epochs={cfg.train.epochs:g}", flush=True)
    print(f"lr: {describe_schedule(cfg.train)}", flush=True)
    if (optimizers := describe_optimizers(model, cfg.train, ps)) is not None:
        print(optimizers, flush=True)
    wandb_run = start_wandb(cfg.run.wandb_project, run_dir, to_dict(cfg)) if cfg.run.wandb else None
    print(eval_plan(cfg, val_set), flush=True)
    return MetricsLog(run_dir / "metrics.jsonl", start if start else None, wandb_run)


class TokenCount:
    """The real target tokens trained on, on the device (read on logging steps only): in all,
    per blend source, and since the current interval began (tokens/s)."""

    def __init__(self, saved: dict, n_sources: int, device: torch.device):
        """saved: a checkpoint's or snapshot's counters (none at a fresh start)."""
        self.total = torch.tensor(float(saved.get("tokens", 0)), dtype=torch.float64, device=device)
        self.per_source = torch.tensor(saved.get("tokens_per_source", [0.0] * n_sources),
                                       dtype=torch.float64, device=device)
        self.restart()

    def add(self, per_source: torch.Tensor) -> torch.Tensor:
        """Count a step's tokens of each source (all DP ranks'); returns their sum."""
        n = per_source.sum()
        self.per_source += per_source
        self.total += n
        return n

    def counters(self) -> dict:
        """What a checkpoint or snapshot keeps of it (waits for the device)."""
        return {"tokens": int(self.total.item()), "tokens_per_source": self.per_source.tolist()}

    def by_source(self, data: PreparedData) -> dict:
        """A blend's tokens so far from each source (metrics.jsonl), by the path given."""
        if len(data.train) == 1:
            return {}
        return {"tokens_per_source": {s.name: int(n) for s, n in zip(data.train, self.per_source.tolist())}}

    def restart(self) -> None:
        self.since, self.total_then = time.perf_counter(), self.total.clone()

    def rate(self) -> float:
        """Tokens per second since the interval began (waits for the device)."""
        return (self.total - self.total_then).item() / (time.perf_counter() - self.since)


class Preempted(Exception):
    """Raised on every rank after the checkpoint of an agreed early stop."""


def resume(path: Path | None, model, ps: ParallelState, cfg: Config) -> dict:
    """The step (and token counters) to start from: {"step": 0}, or the checkpoint's meta, its
    weights and RNG state loaded (the optimizer's are loaded once the engine exists)."""
    if path is None:
        return {"step": 0}
    meta, rng = load_checkpoint(path, model, ps)
    if rng is not None:
        restore_run_rng(model.rng, rng)
    if not ps.is_main:
        return meta
    saved, layout = meta.get("layout", {}), layout_of(ps)
    lines = [f"resumed from {path} at step {meta['step']}"]
    if saved != layout:
        def shown(l: dict) -> str:
            return " x ".join(f"{k.upper()}{l.get(k, 1)}" for k in ("tp", "cp", "pp", "dp"))
        dropout = "; dropout's random streams start afresh" if cfg.model.dropout else ""
        lines.append(f"  layout: saved at {shown(saved)}, now {shown(layout)}: weights and "
                     f"optimizer state resharded{dropout}")
    if meta.get("sample_order") != SAMPLE_ORDER:
        lines.append("  sample order: the checkpoint's megalite drew each epoch's order from a "
                     "table (and held out over 1,024 validation documents one by one); this one "
                     "draws it by shuffle.py's keyed permutation, so the steps from here read "
                     "other samples than that version would have")
    print("\n".join(lines), flush=True)
    return meta


def samples(cfg: Config, model, data: PreparedData, ps: ParallelState, run_dir: Path) -> None:
    s, tok = cfg.sample, data.tokenizer
    if not s.prompts:  # nothing asked: no header, and no samples.txt of an earlier end
        if ps.is_main:
            (run_dir / "samples.txt").unlink(missing_ok=True)
        return
    if ps.cp_size > 1:
        if ps.is_main:
            print(f"samples skipped: generation decodes with a KV cache, which runs without context "
                  f"parallelism (parallel.cp={ps.cp_size}); sample from the checkpoint with "
                  f"`megalite generate`", flush=True)
        return
    texts = []
    # Conversations: each prompt a user's message, rendered with the data's chat template.
    template = None if cfg.data.chat_template is None else load_chat_template(tok, None)
    for i, prompt in enumerate(s.prompts):  # one at a time, each with its own seed
        # Encoded as the documents were: bos first where the tokenizer's template puts it.
        ids = tok.encode(prompt) if template is None else \
            generation_prompt(template, tok, [{"role": "user", "content": prompt}])[1]
        texts.append(sampled(model, tok, [prompt], [ids], s.max_new_tokens, temperature=s.temperature,
                             top_k=s.top_k, seed=cfg.run.seed + i))
    if ps.is_main:
        text = "\n".join(texts)
        (run_dir / "samples.txt").write_text(text + "\n")
        print(f"samples (temperature {s.temperature}, top-k {s.top_k}):\n{text}", flush=True)


def report_data(data: PreparedData) -> None:
    m = data.meta
    # Truncations are counted per shard (cached), so over the sources' held-out part too.
    held_out = {v.name for v in data.val} & {s.name for s in data.train}
    notes = [f"{m['train_documents']} training documents ({m['train_tokens']} tokens), "
             f"{m['val_documents']} validation documents ({m['val_tokens']} tokens)",
             len(data.train) > 1 and "blend " + ", ".join(f"{s.weight:.3g} {s.name}" for s in data.train),
             m["empty"] and f"{m['empty']} empty documents skipped",
             skipped_records(m, "the prepared data's meta.json"),
             m["invalid_utf8"] and f"{m['invalid_utf8']} documents had bytes that are not UTF-8 "
                                   f"(replaced with U+FFFD)",
             m["truncated"] and f"{m['truncated']} documents longer than data.seq_len were truncated"
                                + (" (held-out documents included)" if held_out else ""),
             m["dropped"] and f"{m['dropped']} documents longer than a row (data.seq_len + 1 tokens) were "
                              f"left out (data.drop_longer)"]
    print("data: " + "; ".join(note for note in notes if note), flush=True)  # the counts not 0


if __name__ == "__main__":
    from megalite.cli import run_reporting_errors
    sys.exit(run_reporting_errors(main, sys.argv[1:]))
