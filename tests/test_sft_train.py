"""Fine-tuning on conversations, as people run it: a transformers model (Qwen2-shaped, and a
Mixtral-shaped MoE for EP) with its tokenizer and chat template, `train.init_from` it, jsonl
conversations rendered by data.chat_template=auto, the assistant's turns the only targets.

- Every layout trains as one process does, padded and packed: 10 steps' losses and gradient
  norms (clipping active), fp32 to 1e-5, and final weights to 1e-4.
- The trainer's first loss is the mean over the assistant's tokens of what transformers' own
  model predicts for each conversation alone, the targets taken from transformers'
  `return_assistant_tokens_mask`: a prompt token counted as a target, or a packed conversation
  seeing its neighbour, would change it (both alternatives are computed and shown to differ).
- The fine-tuned model exported to a Hugging Face directory carries the chat template:
  transformers loads it, renders the held-out conversations, and gives the masked loss
  `megalite eval --chat` gives; it generates from a chat prompt what `megalite generate --chat`
  generates.
"""
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megalite.data.batches import BatchOrder
from megalite.prep.command import prepare_for_run
from megalite.evaluate import main as evaluate_main
from megalite.generate import main as generate_main
from megalite.hf.convert import main_export
from megalite.run_config import given_keys, load_config
from megalite.run_setup import with_epochs, with_pretrained
from megalite.typed_config import ConfigError
from megalite.plan import sample_sets
from tests.support.chat import QWEN
from tests.support.data import write_records
from tests.support.harness import run_distributed
from tests.support.runs import STEPS, assert_same_training, losses, one_process_runs, train_run

transformers = pytest.importorskip("transformers")

WORDS = ("tensor parallel rows columns heads vocabulary split gather reduce scatter pipeline "
         "stage micro batch expert router token loss gradient norm clip warmup decay cosine "
         "checkpoint resume shard layout rank world group sequence context window cache").split()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SEQ = 96
ASKED = "Which rank holds the heads?"  # the trainer's sample prompt, a user's message
LAYOUTS = {  # name -> (model, world, settings)
    "tp2-dp2": ("dense", 4, ["parallel.tp=2"]),
    "tp2-sp": ("dense", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": ("dense", 2, ["parallel.pp=2"]),
    "cp2": ("dense", 2, ["parallel.cp=2"]),
    "ep2": ("moe", 2, ["parallel.ep=2"]),
}


def conversations(seed: int, count: int) -> list[dict]:
    """Records of both shapes: messages (a system prompt or not, one or two exchanges) and
    prompt/completion."""
    rng = random.Random(seed)

    def say(n):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, n))).capitalize() + "."

    records = []
    for i in range(count):
        if i % 4 == 3:
            records.append({"prompt": say(5), "completion": say(8)})
            continue
        messages = [{"role": "system", "content": say(4)}] if i % 2 else []
        for _ in range(1 + i % 3 // 2):
            messages += [{"role": "user", "content": say(5)}, {"role": "assistant", "content": say(8)}]
        records.append({"messages": messages})
    return records


def as_messages(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]}]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    train, held = conversations(0, 40), conversations(1, 6)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for r in train + held for m in as_messages(r)] + [
        "system user assistant You are a helpful assistant."] * 5
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    common = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ * 2, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, initializer_range=0.2, eos_token_id=tok.token_to_id("<|im_end|>"))
    hf = {"dense": transformers.Qwen2Config(intermediate_size=48, **common),
          "moe": transformers.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                            num_experts_per_tok=2, **common)}
    dirs = {}
    for name, config in hf.items():
        torch.manual_seed(0)
        directory = dirs[name] = root / name
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        tok.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN}))
    return SimpleNamespace(root=root, dirs=dirs, train=write_records(root / "train.jsonl", train),
                           held=write_records(root / "held.jsonl", held), held_records=held)


def settings(sft, model: str, mode: str, run_dir) -> list[str]:
    return [f"train.init_from={sft.dirs[model]}", f"data.path={sft.train}",
            f"data.val_path={sft.held}", "data.chat_template=auto", f"data.mode={mode}",
            f"data.seq_len={SEQ}", f"data.cache_dir={sft.root / 'cache'}",
            f"train.max_steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.warmup_steps=2", "train.lr=3e-3", "train.grad_clip=0.1", "train.eval_tokens=0",
            f"sample.prompts=['{ASKED}']", "sample.max_new_tokens=6", "sample.temperature=0",
            f"run.dir={run_dir}"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, sft):
    runs = one_process_runs(tmp_path_factory)

    def run(model: str, mode: str):
        return runs((model, mode), lambda run_dir: settings(sft, model, mode, run_dir),
                    f"single-{model}-{mode}")
    return run


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["padded", "packed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fine_tuning_trains_like_one_process(tmp_path, sft, single, layout, mode):
    model, world, extra = LAYOUTS[layout]
    train_run(world, settings(sft, model, mode, tmp_path) + extra)
    # Weights to 1e-4: an embedding row of a token seen only in prompts has gradients near
    # Adam's eps, where the update's size is the gradient's own, last bits included.
    assert_same_training(single(model, mode), tmp_path, weights_tol=1e-4)


def rendered_by_transformers(directory, records) -> list[tuple[list[int], list[int]]]:
    """Each conversation's ids and assistant mask from transformers' own tokenizer and
    apply_chat_template, eos appended (not a target) where the template did not end with it:
    the document's end, as prepared data stores it."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    out = []
    for record in records:
        got = tok.apply_chat_template(as_messages(record), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = list(got["input_ids"]), list(got["assistant_masks"])
        if ids[-1] != tok.eos_token_id:
            ids, mask = ids + [tok.eos_token_id], mask + [0]
        out.append((ids, mask))
    return out


def masked_loss(hf, pieces, targets_only: bool = True) -> float:
    """The mean cross-entropy of transformers' model over the targets of each piece, run alone:
    (ids, the token each position predicts, whether it is a target). targets_only=False: every
    position with a token to predict counts."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, nexts, keep in pieces:
            logits = hf(input_ids=torch.tensor([ids])).logits[0].double()
            for position, (token, target) in enumerate(zip(nexts, keep)):
                if token is not None and (target or not targets_only):
                    total += float(F.cross_entropy(logits[position], torch.tensor(token)))
                    count += 1
    return total / count


def joined(pieces) -> tuple:
    """Pieces as one sequence: each position predicts what it did in its own piece."""
    return tuple(sum((list(p[k]) for p in pieces), []) for k in range(3))


def first_batch_pieces(sft, mode: str, run_dir, rendered) -> list[list[tuple]]:
    """The trainer's first global batch (its own batching code: which rows, and where a packed
    row's documents start) as pieces of the conversations transformers rendered: for each
    row, its documents' pieces (masked_loss's)."""
    argv = settings(sft, "dense", mode, run_dir)
    cfg = with_pretrained(load_config(None, argv), given_keys(None, argv))
    data = prepare_for_run(cfg.data)
    train_set = sample_sets(data.train, cfg, data)
    order = BatchOrder(train_set.sizes, train_set.weights, cfg.train.global_batch_size, cfg.run.seed)
    batch = train_set.collate(order.global_batch_picks(0))
    rows = []
    for row in range(batch.input_ids.shape[0]):
        ids = batch.input_ids[row].tolist()
        if mode == "padded":  # one conversation, its first SEQ + 1 tokens
            n = int(batch.attention_mask[row].sum())
            (doc,) = [i for i, (c, _) in enumerate(rendered) if c[:n] == ids[:n]]
            spans = [(doc, 0, n)]
        else:  # documents numbered by the store: the records' order
            docs = batch.doc_ids[row].tolist()
            cuts = [0] + [i for i in range(1, len(docs)) if docs[i] != docs[i - 1]] + [len(docs)]
            spans = []
            for first, end in zip(cuts, cuts[1:]):
                length, whole = end - first, len(rendered[docs[first]][0])
                # A document starts within the row, except the first, which may be the end of
                # one begun in the row before (or the middle of a long one: then found).
                at = 0 if first > 0 else whole - length if end < len(docs) else next(
                    o for o in range(whole) if rendered[docs[first]][0][o:o + length] == ids[first:end])
                spans.append((docs[first], at, length))
        pieces = []
        for doc, at, length in spans:
            c, mask = rendered[doc]
            following = c[at + 1:at + length + 1] + [None] * (at + length + 1 - len(c))
            pieces.append((c[at:at + length], following, [bool(m) for m in mask[at + 1:at + length + 1]]
                           + [False] * (at + length + 1 - len(c))))
        assert mode == "padded" or joined(pieces)[0] == ids
        rows.append(pieces)
    return rows


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_the_loss_is_the_mean_over_the_assistant_tokens(sft, single, mode):
    run_dir = single("dense", mode)
    records = [json.loads(line) for line in sft.train.read_text().splitlines()]
    rendered = rendered_by_transformers(sft.dirs["dense"], records)
    hf = transformers.AutoModelForCausalLM.from_pretrained(sft.dirs["dense"], dtype=torch.float32).eval()
    rows = first_batch_pieces(sft, mode, run_dir, rendered)
    pieces = [p for row in rows for p in row]
    expected, trained = masked_loss(hf, pieces), losses(run_dir)[1]
    tol = 1e-5 * expected
    assert abs(trained - expected) <= tol, (trained, expected)
    # What the comparison rules out, each missing it by more than 10x its tolerance: prompt
    # tokens counted as targets; in a packed row, a conversation that sees the one before it.
    assert abs(masked_loss(hf, pieces, targets_only=False) - expected) > 10 * tol
    if mode == "packed":
        assert any(len(row) > 1 for row in rows)
        assert abs(masked_loss(hf, [joined(row) for row in rows]) - expected) > 10 * tol


@pytest.mark.exactness
def test_the_exported_model_evaluates_and_generates_as_transformers(tmp_path, sft, single, capsys):
    """megalite export writes the chat template with the tokenizer; transformers' masked loss
    on the held-out conversations is `megalite eval --chat`'s, in one process, at TP2 and at DP2
    (each rank half the conversations), and its greedy answer to a chat prompt is `megalite generate
    --chat`'s."""
    ckpt = single("dense", "padded") / "checkpoints" / f"step_{STEPS:08d}"
    out = tmp_path / "hf"
    assert main_export(["--ckpt", str(ckpt), "--to-hf", str(out), "--dtype", "fp32"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == QWEN
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rendered = rendered_by_transformers(out, sft.held_records)
    assert max(len(ids) for ids, _ in rendered) <= hf.config.max_position_embeddings  # one window
    expected = masked_loss(hf, [(ids, ids[1:] + [None], [bool(m) for m in mask[1:]] + [False])
                                for ids, mask in rendered])
    capsys.readouterr()
    argv = ["--ckpt", str(ckpt), "--chat", str(sft.held), "--json"]
    assert evaluate_main(argv) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["tokens"] == sum(sum(mask) for _, mask in rendered)
    assert abs(ours["loss"] - expected) <= 1e-5 * expected, (ours, expected)
    for layout in (["--tp", "2"], []):  # TP2; DP2, each rank half the conversations
        result = run_distributed(eval_at, 2, argv + layout, torchrun_env=True)[0]
        assert result["tokens"] == ours["tokens"]
        assert abs(result["loss"] - expected) <= 1e-5 * expected, (layout, result, expected)

    asked = as_messages(sft.held_records[0])[:-1]
    prompt = tok.apply_chat_template(asked, add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    theirs = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=12, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    theirs = theirs[0, len(prompt):].tolist()
    assert generate_main(["--ckpt", str(ckpt), "--chat", json.dumps(asked),
                          "--max-new-tokens", "12"]) == 0
    shown = capsys.readouterr().out
    assert shown.endswith(tok.decode(list(prompt) + theirs, skip_special_tokens=False) + "\n"), shown
    # The trainer's own sample asks its prompt as a user's message, rendered the same way.
    assert generate_main(["--ckpt", str(ckpt), "--chat", json.dumps(
        [{"role": "user", "content": ASKED}]), "--max-new-tokens", "6"]) == 0
    answer = capsys.readouterr().out.split("\n<|im_start|>assistant\n", 1)[1]
    assert (ckpt.parent.parent / "samples.txt").read_text() == f"--- {ASKED!r}\n{ASKED}{answer}"


def eval_at(argv: list[str]) -> dict:
    import contextlib
    import io
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert evaluate_main(argv) == 0
    return json.loads(printed.getvalue() or "{}")


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_conversations_longer_than_a_row_are_left_out_and_counted(tmp_path, sft, mode):
    """data.drop_longer: the conversations of more than SEQ + 1 tokens (as transformers renders
    them) are neither cut (padded) nor run into the next row (packed): left out, counted."""
    records = [json.loads(line) for line in sft.train.read_text().splitlines()]
    lengths = [len(ids) for ids, _ in rendered_by_transformers(sft.dirs["dense"], records)]
    argv = settings(sft, "dense", mode, tmp_path) + ["data.drop_longer=true"]
    data = prepare_for_run(with_pretrained(load_config(None, argv), given_keys(None, argv)).data)
    held = [len(ids) for ids, _ in rendered_by_transformers(sft.dirs["dense"], sft.held_records)]
    longer = sum(n > SEQ + 1 for n in lengths)
    assert 0 < longer < len(records)
    assert data.meta["dropped"] == longer + sum(n > SEQ + 1 for n in held)  # held-out ones too
    assert data.meta["truncated"] == 0 and data.meta["train_documents"] == len(records) - longer
    (train,) = data.train
    kept = train.docs.lengths(np.arange(len(train.docs)))
    assert sorted(kept.tolist()) == sorted(n for n in lengths if n <= SEQ + 1)
    with pytest.raises(ConfigError, match=r"all 40 documents are longer than a row \(data\.seq_len=8 "
                                          r"\+ 1 tokens\).*raise data\.seq_len, or set data\.drop_longer=false"):
        prepare_for_run(with_pretrained(load_config(None, argv + ["data.seq_len=8"]), given_keys(None, argv)).data)


@pytest.mark.unit
def test_epochs_set_the_steps(sft, tmp_path):
    cfg = load_config(None, settings(sft, "dense", "padded", tmp_path) + ["train.epochs=2.5"])
    assert with_epochs(cfg, 40).train.max_steps == 13  # ceil(2.5 x 40 / 8)
    with pytest.raises(ConfigError, match=r"train\.warmup_steps=20 is not below the 13 steps of "
                                          r"train\.epochs=2\.5 .*lower train\.warmup_steps"):
        with_epochs(load_config(None, settings(sft, "dense", "padded", tmp_path)
                                + ["train.epochs=2.5", "train.warmup_steps=20"]), 40)
    with pytest.raises(ConfigError, match=r"train\.epochs=-1\.0 must be > 0"):
        with_epochs(load_config(None, ["train.epochs=-1"]), 40)


@pytest.mark.e2e
def test_a_bad_conversation_is_named(tmp_path, sft, single):
    ckpt = single("dense", "padded") / "checkpoints" / f"step_{STEPS:08d}"
    bad = write_records(tmp_path / "bad.jsonl", [sft.held_records[0], {"text": "not a conversation"}])
    with pytest.raises(ConfigError, match=r"--chat '.*bad\.jsonl' line 2: the record has neither "
                                          r"'messages' nor 'prompt' and 'completion'"):
        evaluate_main(["--ckpt", str(ckpt), "--chat", str(bad)])
    with pytest.raises(ConfigError, match=r"--chat 'hello': .*give a JSON list of"):
        generate_main(["--ckpt", str(ckpt), "--chat", "hello"])


@pytest.mark.e2e
def test_data_of_another_tokenizer_names_train_init_from(tmp_path, sft):
    """Prepared data whose tokenizer is not the pretrained model's: the error names the
    setting that brought the model's tokenizer, train.init_from, not data.tokenizer."""
    from megalite.prep.shards import PrepareSettings, prepare_directory
    from megalite.train import main as train_main
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(WORDS * 3, trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other.save(str(tmp_path / "other.json"))
    docs = write_records(tmp_path / "docs.jsonl", [{"text": " ".join(WORDS)}] * 8)
    prepare_directory([docs], tmp_path / "prepared", PrepareSettings(
        tokenizer=str(tmp_path / "other.json"), progress=False))
    with pytest.raises(ConfigError, match=r"different tokenizers: .*'train\.init_from' \(.*dense/"
                                          r"tokenizer\.json.*train\.init_from's model reads its own "
                                          r"tokenizer's ids: prepare the data again with it"):
        train_main([f"train.init_from={sft.dirs['dense']}", f"data.path={tmp_path / 'prepared'}",
                    f"run.dir={tmp_path / 'run'}"])
