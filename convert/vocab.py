"""The tokenizer part of pykv convert: a byte-level BPE tokenizer.json (tokens as it spells
them, tokenizer.ggml.pre naming its pre-tokenizer) or a SentencePiece tokenizer.model (pieces,
scores and token types), plus BOS/EOS, add_bos and the chat template from
tokenizer_config.json, as llama.cpp's converter stores them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

from pykv.errors import ConvertError


def _pre_tokenizer(tok: dict) -> str:
    """tokenizer.ggml.pre for the pre-tokenizers pykv implements, read from tokenizer.json."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds and kinds[-1] == "ByteLevel" and any(
            "\\p{N}{1,3}" in (s.get("pattern") or {}).get("Regex", "") for s in steps):
        return "llama-bpe"
    raise ConvertError(f"tokenizer.json's pre-tokenizer ({kinds}) is not one pykv knows; "
                       "name it with --pre (gpt2, llama-bpe, qwen2, smollm, default)")


def _is_byte_level(tok: dict) -> bool:
    model = tok.get("model", {})
    return (model.get("type") == "BPE" and not model.get("byte_fallback")
            and (tok.get("decoder") or {}).get("type") == "ByteLevel")


def add_vocab(w, model_dir: Path, n_vocab: int, pre: Optional[str]) -> None:
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if tok is not None and _is_byte_level(tok):
        _add_bpe_vocab(w, model_dir, tok, n_vocab, pre)
    elif (model_dir / "tokenizer.model").exists():   # Llama 2, Mistral: SentencePiece
        _add_spm_vocab(w, model_dir, n_vocab)
    elif tok is not None:
        raise ConvertError("tokenizer.json is not a byte-level BPE vocabulary and there is no tokenizer.model")
    else:
        raise ConvertError(f"{model_dir} has no tokenizer.json or tokenizer.model")


def _add_spm_vocab(w, model_dir: Path, n_vocab: int) -> None:
    """Pieces, scores and token types from the SentencePiece model, as llama.cpp stores them."""
    import gguf
    try:
        import sentencepiece
    except ImportError as exc:
        raise ConvertError("a tokenizer.model vocabulary needs the sentencepiece package "
                           "(pip install sentencepiece)") from exc
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i) else
                     T.BYTE if sp.is_byte(i) else T.UNUSED if sp.is_unused(i) else T.NORMAL)
    for i in range(len(tokens), n_vocab):   # a model may have rows past the tokenizer's pieces
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(T.UNUSED)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _add_bpe_vocab(w, model_dir: Path, tok: dict, n_vocab: int, pre: Optional[str]) -> None:
    import gguf

    model = tok["model"]
    tokens: Dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in tokens}
    for added in tok.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    size = max(n_vocab, max(tokens) + 1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or _pre_tokenizer(tok))
    w.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(size)])
    w.add_token_types([types.get(i, gguf.TokenType.UNUSED) for i in range(size)])
    # merges, BOS/EOS/PAD ids, add_bos and the chat template, from tokenizer_config.json
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=size).add_to_gguf(w, quiet=True)
