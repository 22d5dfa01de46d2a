"""Vocabulary-only GGUFs and reference tokenizers for the tokenizer tests.

* SentencePiece: the Mistral tokenizer models (v1 and v3) shipped inside the PyPI wheel of
  ``mistral-common``. The wheel is fetched once with ``pip download --no-deps`` into
  tests/models/ (gitignored) and never installed; the ``.model`` files are read from the zip.
  ``spm_gguf`` turns one into a vocab-only GGUF the way llama.cpp's converter does (tokens,
  scores, token types from the SentencePiece model), and the ``sentencepiece`` package is the
  reference.
* BPE: ``bpe_gguf_variant`` copies the vocabulary and merges of a byte-level GGUF (SmolLM2)
  into a vocab-only GGUF with another ``tokenizer.ggml.pre``, so each pre-tokenizer can be
  checked against an HF ``tokenizers`` pipeline built with the same regexes.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import zipfile
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
MISTRAL_COMMON = "mistral-common==1.13.1"
SPM_MEMBERS = {
    "v1": "mistral_common/data/tokenizer.model.v1",
    "v3": "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3",
}

# gguf token types (llama.cpp llama_token_type)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6


class DownloadError(RuntimeError):
    """pip download failed; ``output`` holds what pip printed."""

    def __init__(self, msg: str, output: str):
        super().__init__(msg)
        self.output = output


def mistral_common_wheel() -> Path:
    """The cached mistral-common wheel, downloaded (not installed) on first use."""
    found = sorted(glob.glob(str(MODELS_DIR / "mistral_common-1.13.1-*.whl")))
    if found:
        return Path(found[0])
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", MISTRAL_COMMON, "-d", str(MODELS_DIR)],
        capture_output=True, text=True, timeout=600)
    found = sorted(glob.glob(str(MODELS_DIR / "mistral_common-1.13.1-*.whl")))
    if proc.returncode != 0 or not found:
        raise DownloadError(f"pip download {MISTRAL_COMMON} failed (exit {proc.returncode})",
                            proc.stdout + proc.stderr)
    return Path(found[0])


def spm_model_bytes(version: str) -> bytes:
    with zipfile.ZipFile(mistral_common_wheel()) as z:
        return z.read(SPM_MEMBERS[version])


def spm_gguf(model_proto: bytes, path: Path) -> Path:
    """Write a vocab-only llama GGUF whose tokenizer is this SentencePiece model."""
    import gguf
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(TT_UNKNOWN)
        elif sp.is_control(i):
            types.append(TT_CONTROL)
        elif sp.is_byte(i):
            types.append(TT_BYTE)
        elif sp.is_unused(i):
            types.append(TT_UNUSED)
        else:
            types.append(TT_NORMAL)
    w = gguf.GGUFWriter(str(path), "llama")
    _minimal_llama_hparams(w, len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    _finish(w)
    return path


def _minimal_llama_hparams(w, n_vocab: int) -> None:
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_bpe_vocab(gguf_path: Path) -> dict:
    """tokens, token types, merges and special ids of a byte-level GGUF."""
    import gguf

    r = gguf.GGUFReader(str(gguf_path))

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    return {
        "tokens": field("tokenizer.ggml.tokens"),
        "types": field("tokenizer.ggml.token_type"),
        "merges": field("tokenizer.ggml.merges"),
        "bos": field("tokenizer.ggml.bos_token_id"),
        "eos": field("tokenizer.ggml.eos_token_id"),
    }


def bpe_gguf_variant(vocab: dict, pre: str, path: Path, add_bos: bool = False, chat_template=None) -> Path:
    """A vocab-only GGUF with this BPE vocabulary and tokenizer.ggml.pre = pre."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    _minimal_llama_hparams(w, len(vocab["tokens"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    _finish(w)
    return path


# The regexes of llama.cpp's pre-tokenizers (llama-vocab.cpp), in HF `tokenizers` syntax.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {
    "gpt2": [GPT2_SPLIT],
    "llama-bpe": [LLAMA3_SPLIT],
    "qwen2": [LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")],
    "smollm": [r"\p{N}", GPT2_SPLIT],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"],
}


def hf_bpe_reference(hf_tokenizer, pre: str):
    """A `tokenizers.Tokenizer` with hf_tokenizer's vocabulary, merges and added tokens, and
    the pre-tokenizer llama.cpp uses for `pre`: each regex splits every piece (kept whole
    otherwise, behavior "isolated"), then bytes become GPT-2 characters. Llama 3 sets
    ignore_merges, as its tokenizer.json does."""
    from tokenizers import Tokenizer

    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
          for rx in PRE_SPLITS[pre]),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}
    spec["post_processor"] = None
    spec["model"]["ignore_merges"] = pre == "llama-bpe"
    return Tokenizer.from_str(json.dumps(spec))
