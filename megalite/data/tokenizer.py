"""Tokenizers: megalite's byte-level BPE trained locally, a tokenizer.json, or a Hugging Face
tokenizer directory (tokenizer.json, with tokenizer_config.json and special_tokens_map.json
where present).

End of document (eos): the name given (data.eos_token, --eos-token), else the one the
directory's files declare, else the one of KNOWN["eos_token"] the tokenizer holds. None is an
error naming the key, and so are several in a directory whose files name none; a tokenizer.json
alone (all that older prepared directories and checkpoints hold) takes the first in KNOWN's
order, as earlier versions did. Text is encoded as the tokenizer's own template says: Llama's
post-processor puts bos first, GPT-2's and megalite's BPE add nothing.

Padding needs no token of its own: no real token sees a padded position (causal attention
hides right padding, the attention mask left padding) and its labels are out of the loss, so
any id may fill them. The fill id (`pad_id`) is the tokenizer's pad token, else eos.

megalite's BPE puts its special tokens first, eos = 0, bos = 1, pad = 2: the pad id is
deliberately not 0, and 0 is a real token, so a collate that pads with 0 instead of the pad id
is caught by the tests.
"""
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megalite.data.indexed import write_atomic
from megalite.typed_config import ConfigError

SPECIAL = ("<|eos|>", "<|bos|>", "<|pad|>")
# In order of preference (earlier versions' order, then the names added since).
KNOWN = {"eos_token": ("<|eos|>", "</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"),
         "bos_token": ("<|bos|>", "<s>", "<bos>", "<|begin_of_text|>"),
         "pad_token": ("<|pad|>", "<pad>", "[PAD]")}
# The files a stored tokenizer is made of; tokenizer.json is written last, so that its presence
# means the others are there.
FILES = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")


@dataclass(frozen=True)
class TokenizerInfo:
    tokenizer: Tokenizer
    file: Path  # its tokenizer.json
    names: dict  # eos_token, bos_token and pad_token (those it has): what a stored copy declares
    source_files: dict  # the source's tokenizer_config.json, special_tokens_map.json (stored too)
    digest: str  # what the token ids of a document depend on (see load_tokenizer)
    # Its chat template (chat_template.jinja beside it, else tokenizer_config.json's), which
    # travels with it into prepared data, checkpoints and exports; None: it has none.
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eos_id(self) -> int:
        return self.tokenizer.token_to_id(self.names["eos_token"])

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.names["bos_token"]) if "bos_token" in self.names else None

    @property
    def pad_id(self) -> int:
        """The id that fills padded positions: any id would do (see the module's note), the pad
        token where the tokenizer has one, else eos."""
        return self.tokenizer.token_to_id(self.names.get("pad_token", self.names["eos_token"]))

    def encode(self, text: str) -> list[int]:
        """The text's tokens with the tokenizer's template (Llama's bos first)."""
        return self.tokenizer.encode(text).ids

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Each document as encode() gives it, then eos unless the template put it there."""
        eos = [] if self._template_ends_with_eos else [self.eos_id]
        # The fast variant skips character offsets, which a document never needs.
        return [e.ids + eos for e in self.tokenizer.encode_batch_fast(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @cached_property
    def _template_ends_with_eos(self) -> bool:
        """Whether the template puts eos after a text. Seen around a text of a token or more
        ("a"): the empty text's template is [eos] too where eos comes first only (OPT's bos
        is its eos)."""
        bare = self.tokenizer.encode("a", add_special_tokens=False).ids
        return self.encode("a")[-1:] == [self.eos_id] and bare[-1:] != [self.eos_id]


def train_bpe(documents: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def load_tokenizer(path: Path, eos_token: str | None = None) -> TokenizerInfo:
    """A Hugging Face tokenizer directory, or its tokenizer.json: tokenizer.json with, where
    present, the tokenizer_config.json and special_tokens_map.json beside it that name its
    special tokens (the map overriding the config, as transformers reads them); a file of any
    other name is read alone. `eos_token` names eos over what the files say.

    The digest: tokens depend on tokenizer.json and the eos id. A tokenizer.json whose eos is
    the one it gives alone and whose template adds nothing keeps its file's hash, the key
    earlier versions gave its data and checkpoints; the others' hash covers the eos too."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"tokenizer '{path}' " + ("holds no tokenizer.json (the fast tokenizer's "
                          "file, which megalite reads)" if path.is_dir() else "not found") +
                          ": give a tokenizer.json, a Hugging Face tokenizer directory holding "
                          "one, or data.tokenizer=bpe to train one")
    text = file.read_bytes()
    tokenizer = Tokenizer.from_str(text.decode())
    # A file saved with truncation or padding on would cut or pad every document.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    beside = file.parent if file.name == "tokenizer.json" else None
    source_files = {name: json.loads((beside / name).read_text()) for name in FILES[:2]
                    if beside is not None and (beside / name).is_file()}
    declared = {key: name for content in source_files.values() for key, name in content.items()}
    if eos_token is not None:
        declared["eos_token"] = eos_token
    # Names are looked up among the added tokens, where a tokenizer declares its special ones
    # (its vocabulary may hold '</s>' as text); in the vocabulary of one that declares none.
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()} or \
        set(tokenizer.get_vocab())
    found = {key: [n for n in known if n in added] for key, known in KNOWN.items()}
    names = {}
    for key in KNOWN:
        name = declared.get(key)  # a name, or a dict with a "content" key
        name = name.get("content") if isinstance(name, dict) else name
        if name is not None and tokenizer.token_to_id(name) is None:
            given = "the eos token given" if key == "eos_token" and eos_token else f"its {key}"
            raise ConfigError(f"tokenizer '{path}': {given} '{name}' is not in its vocabulary: "
                              f"name one of its tokens")
        if name is None and key == "eos_token" and (not found[key] or
                                                     (len(found[key]) > 1 and source_files)):
            what = (f"several end-of-document tokens ({', '.join(found[key])}) and no "
                    f"tokenizer_config.json or special_tokens_map.json naming one" if found[key] else
                    f"no end-of-document token megalite knows ({', '.join(KNOWN['eos_token'])})")
            raise ConfigError(f"tokenizer '{path}' has {what}: name the one that ends a document "
                              f"with data.eos_token=NAME (--eos-token NAME for prepare-data and import)")
        if name is not None or found[key]:  # else the tokenizer has none
            names[key] = found[key][0] if name is None else name
    file_hash = hashlib.sha256(text).hexdigest()
    # Its eos is the one its tokenizer.json alone gives (the first known name it holds), and
    # its post-processor adds no ids around a text.
    plain = found["eos_token"][:1] == [names["eos_token"]] and not tokenizer.encode("").ids
    digest = file_hash if plain else \
        hashlib.sha256(f"{file_hash}|eos={names['eos_token']}".encode()).hexdigest()
    # Its chat template: chat_template.jinja beside it, else tokenizer_config.json's.
    jinja = file.parent / "chat_template.jinja"
    template = source_files.get("tokenizer_config.json", {}).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    template = jinja.read_text() if beside is not None and jinja.is_file() else template or None
    return TokenizerInfo(tokenizer, file, names, source_files, digest, template)


def save_tokenizer(info: TokenizerInfo, directory: Path) -> None:
    """`info` as a Hugging Face tokenizer directory: tokenizer.json and the files naming its
    specials (the source's, with the names resolved), so that loading it gives them back, and
    its chat template as chat_template.jinja (one place: transformers reads it from there)."""
    directory = Path(directory)
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              **info.source_files.get("tokenizer_config.json", {}), **info.names}
    if info.chat_template is not None:
        config.pop("chat_template", None)
        write_atomic(directory / "chat_template.jinja", info.chat_template)
    special_map = {**info.source_files.get("special_tokens_map.json", {}), **info.names}
    for name, content in zip(FILES, (config, special_map, None)):
        write_atomic(directory / name, info.file.read_bytes() if content is None else
                     json.dumps(content, indent=1))
