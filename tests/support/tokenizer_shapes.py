"""Standard tokenizers as they are: GPT-2's, Llama 2's and Llama 3's shapes, built with the
`tokenizers` library and saved as Hugging Face tokenizer directories (nothing is downloaded),
and a corpus of embedded documents to prepare with them."""
import json
from itertools import islice, product

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from megalite.data.raw_files import EMBEDDED
from megalite.prep.sources import documents
from tests.support.data import write_jsonl


TEXTS = list(islice(documents(EMBEDDED), 400))


def added(content: str) -> dict:
    """A special token as transformers writes it into tokenizer_config.json."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}


def hf_directory(directory, tokenizer: Tokenizer, config: dict, special_map: dict):
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    return directory


def gpt2_shaped(directory):
    """Byte-level BPE of exactly 50,257 ids: 256 bytes, 50,000 merges, `<|endoftext|>` last."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = list(islice(product(alphabet, alphabet), 50_000))
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update((a + b, len(alphabet) + i) for i, (a, b) in enumerate(merges))
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return hf_directory(directory, tok, {"model_max_length": 1024},
                        {name: "<|endoftext|>" for name in ("bos_token", "eos_token", "unk_token")})


def llama2_shaped(directory):
    """`<unk>`, `<s>`, `</s>` first; its template puts `<s>` before a text; no pad."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    names = {"bos_token": added("<s>"), "eos_token": added("</s>"), "unk_token": added("<unk>")}
    return hf_directory(directory, tok, {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                                         "add_eos_token": False, "pad_token": None, **names}, names)


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|reserved_special_token_2|>", "<|eot_id|>",
                  *(f"<|reserved_special_token_{i}|>" for i in range(3, 8))]


def llama3_shaped(directory):
    """Byte-level BPE, its special tokens after the vocabulary, `<|begin_of_text|>` put first
    by the template, `<|end_of_text|>` ending a document, reserved tokens, no pad."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(LLAMA3_SPECIAL)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return hf_directory(directory, tok, {"tokenizer_class": "PreTrainedTokenizerFast",
                                         "bos_token": "<|begin_of_text|>",
                                         "eos_token": "<|end_of_text|>", "model_max_length": 131072},
                        {"bos_token": added("<|begin_of_text|>"), "eos_token": added("<|end_of_text|>")})


SHAPES = {"gpt2": gpt2_shaped, "llama2": llama2_shaped, "llama3": llama3_shaped}


def write_corpus(path):
    """The first 40 documents as jsonl."""
    return write_jsonl(path, TEXTS[:40])
