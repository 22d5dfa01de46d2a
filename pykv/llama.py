"""The Llama class: load a GGUF model, tokenize, evaluate and generate (llama-cpp-python style).

The token loop runs in Python (docs/architecture.md): eval() appends tokens to the context, the
C library computes logits, a C sampler picks the next token, and so on.
"""
from __future__ import annotations

import os
import random
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import _llama_cpp_options, errors
from ._ffi import call_string, check, ffi, lib, new_params
from ._in_use import InUse, hold_each_step, using_context, using_model
from . import _mapped_file
from ._sampling import TokenLogprob, check_n_logprobs, make_sampler, token_logprob
from ._textstream import TextStream
from .caches import common_prefix
from .chat import resolve_template
from .grammar.gbnf import LlamaGrammar, as_grammar, bind as bind_grammar, response_format_grammar
from .policies import parse_budget, policy_args
from .processors import LogitsProcessorList, StoppingCriteriaList, as_callback, processed_logits

Prompt = Union[str, bytes, Sequence[int]]


@dataclass
class GenerationChunk:
    """One streamed step: the text that became safe to show and the token that produced it
    (with logprobs=..., the log-probabilities of the tokens generated since the last chunk;
    with prompt_logprobs=..., the first chunk carries the prompt's)."""
    text: str
    token: int
    logprobs: Optional[List[TokenLogprob]] = None
    prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None


@dataclass
class GenerationResult:
    text: str
    tokens: List[int]
    finish_reason: str                     # "stop" (EOG or stop string), "length", "cancelled"
    prompt_tokens: int = 0
    cached_tokens: int = 0                 # of prompt_tokens, kept from the previous call (not evaluated)
    timings: dict = field(default_factory=dict)
    kv_stats: dict = field(default_factory=dict)
    logprobs: Optional[List[TokenLogprob]] = None   # one per token, with logprobs=...
    # with prompt_logprobs=...: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None


_KV_TYPES = {"f16": "PYKV_TYPE_F16", "f32": "PYKV_TYPE_F32", "q8_0": "PYKV_TYPE_Q8_0"}
# bytes per stored key or value element
_KV_ELEMENT_BYTES = {"f16": 2, "f32": 4, "q8_0": 34 / 32}


def _kv_type_code(kv_type, what: str = "kv_type") -> int:
    """'f16' (default: half the memory, as llama.cpp), 'f32' (the exact path) or 'q8_0'
    (about a quarter of f32, as llama.cpp's -ctk q8_0 -ctv q8_0)."""
    name = str(kv_type).lower()
    if name not in _KV_TYPES:
        raise errors.InvalidArgumentError(f"{what} must be one of {sorted(_KV_TYPES)}, got {kv_type!r}")
    return getattr(lib, _KV_TYPES[name])


def _kv_type_name(code: int) -> str:
    return next(name for name, c in _KV_TYPES.items() if getattr(lib, c) == code)


def _check_tfs_z(tfs_z) -> None:
    if isinstance(tfs_z, bool) or not isinstance(tfs_z, (int, float)):
        raise TypeError(f"tfs_z must be a number, got {type(tfs_z).__name__}")
    if tfs_z != 1.0:
        warnings.warn(f"tfs_z={tfs_z}: pykv has no tail-free sampling (llama.cpp removed it too); it is off",
                      RuntimeWarning, stacklevel=3)


def _named(model: Optional[str], result):
    """A completion dict, or its chunks, with "model" set to model (llama-cpp-python's
    create_*completion(model=...)); as it is when model is None."""
    if model is None:
        return result
    if isinstance(result, dict):
        return dict(result, model=model)

    def chunks():
        for chunk in result:
            yield dict(chunk, model=model)
    return chunks()


def _resolve_model_path(model_path) -> str:
    path = os.fspath(model_path)
    if os.path.exists(path):
        return path
    if path.startswith("hf://") or "/" not in path and not path.endswith(".gguf"):
        from .pull import pull   # a model name such as "smollm2"
        return str(pull(path))
    raise errors.ModelLoadError(f"model file '{path}' does not exist")


def _gpu_absence() -> str:
    """Why a model asked for GPU layers got none: no CUDA backend, or its reason for no GPU."""
    import re
    info = ffi.string(lib.pykv_system_info()).decode()
    found = re.search(r"CUDA = 0 \(([^)]*)\)", info)
    if found:
        return found.group(1)
    return "this pykv was built without CUDA (reinstall with CMAKE_ARGS=\"-DPYKV_CUDA=ON\")"


def _physical_cores() -> int:
    """The thread count of n_threads=0: the physical cores pykv_system_info reports."""
    import re
    match = re.search(r"physical cores = (\d+)", ffi.string(lib.pykv_system_info()).decode())
    return int(match.group(1)) if match else os.cpu_count() or 1


def _optional_lib_function(name):
    """A function of libpykv that a library built before it lacks (None then)."""
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


class Count(int):
    """An int that may also be called: llama-cpp-python's llm.n_ctx() and llm.n_vocab() work
    beside pykv's llm.n_ctx and llm.n_vocab."""

    def __call__(self) -> int:
        return int(self)


def _decode_in_steps(ctx, arr, n, progress):
    """pykv_decode_begin, then pykv_decode_step until the last chunk: the status of the call.
    progress(n_done, n) runs between the chunks, in this thread, with no callback from C;
    False from it stops the call at the next chunk boundary (the step after it returns
    PYKV_ERR_CANCELLED, or, after the last chunk, the call reports a cancel as a cancel
    during that chunk is). An exception from progress, or a KeyboardInterrupt between two
    steps, stops the call there and is raised: the chunks done stay evaluated."""
    begin = _optional_lib_function("pykv_decode_begin")
    if begin is None:   # a library older than the stepped decode: the prompt in one call
        status = lib.pykv_decode(ctx, arr, n)
        if status == lib.PYKV_OK and progress is not None and progress(n, n) is False:
            return _cancelled_after_the_last_chunk()
        return status
    n_done = ffi.new("int32_t *")
    try:
        status = begin(ctx, arr, n)
        if status != lib.PYKV_OK:
            return status
        status = lib.pykv_decode_step(ctx, n_done)
        while status == lib.PYKV_PENDING:
            if progress is not None and progress(n_done[0], n) is False:
                lib.pykv_cancel(ctx)   # the next step reports it, having run nothing
            status = lib.pykv_decode_step(ctx, n_done)
    except BaseException:
        # the C status may not have reached `status` (an interrupt lands as a call returns):
        # ask the context whether the call is still begun, and end it where it is
        if lib.pykv_decode_pending(ctx):
            lib.pykv_cancel(ctx)
            lib.pykv_decode_step(ctx, n_done)
        raise
    if status == lib.PYKV_OK and progress is not None and progress(n, n) is False:
        _cancelled_after_the_last_chunk()
    return status


def _cancelled_after_the_last_chunk():
    """progress returned False after the last chunk: the call evaluated every token and
    reports a cancel, as a cancel that arrives during its last chunk."""
    raise errors.GenerationCancelled("cancelled (after the call's last chunk: its tokens were evaluated)",
                                     lib.PYKV_ERR_CANCELLED)


class Llama:
    """A GGUF model with one context (KV cache) for evaluation and generation."""

    def __init__(self, model_path, *, n_ctx: int = 4096, n_threads: Optional[int] = None,
                 n_batch: int = 512, n_ubatch: Optional[int] = None, seed: int = -1,
                 verbose: bool = False, vocab_only: bool = False, use_mmap: bool = True,
                 policy: str = "full", budget=None, window: Optional[int] = None,
                 sink: Optional[int] = None, policy_kwargs: Optional[dict] = None,
                 evict_every_chunk: bool = False,
                 exact_matmul: bool = False, kv_type: Optional[str] = None, kv_type_v: Optional[str] = None,
                 logits_all: bool = False,
                 embedding: bool = False, pooling_type=None, chat_template: Optional[str] = None,
                 n_gpu_layers: int = 0, main_gpu: int = 0,
                 **llama_cpp_options):
        self._model = None
        self._ctx = None
        self._in_use = InUse()   # the calls running on _model and _ctx: close() waits for them
        # llama-cpp-python's keywords without a pykv name (type_k, n_gpu_layers, ...):
        # checked before anything loads
        compat = _llama_cpp_options.resolve(llama_cpp_options, kv_type, kv_type_v, chat_template)
        kv_type, kv_type_v = compat.kv_type, compat.kv_type_v
        self.chat_format = compat.chat_format   # a name of pykv._chat_formats, or None
        self._chat_template = compat.chat_template if chat_template is None else resolve_template(chat_template)
        self.last_n_tokens_size = compat.last_n_tokens_size   # the penalties' window in create_*completion
        self.n_batch = n_batch
        self.cache = None   # set_cache()
        self._scores = None
        lib.pykv_log_set_level(3 if verbose else 0)
        self.model_path = _resolve_model_path(model_path)
        self.verbose = verbose
        self.set_seed(seed)

        mparams = new_params("struct pykv_model_params", lib.pykv_model_default_params)
        mparams.use_mmap = int(bool(use_mmap))
        mparams.vocab_only = int(bool(vocab_only))
        for name, value, least in (("n_gpu_layers", n_gpu_layers, -1), ("main_gpu", main_gpu, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise errors.InvalidArgumentError(f"{name} must be an integer >= {least}, got {value!r}")
        mparams.n_gpu_layers = n_gpu_layers
        mparams.main_gpu = main_gpu
        out = ffi.new("pykv_model **")
        check(lib.pykv_model_load(self.model_path.encode(), mparams, out))
        self._model = out[0]
        # a mapped file cut short later would crash an evaluation (SIGBUS): eval() checks it
        self._mapped_file = _mapped_file.identity(self.model_path) if use_mmap else None
        self._info = self._read_info()
        if n_gpu_layers and not vocab_only and not self._info["n_gpu_layers"]:
            warnings.warn(f"n_gpu_layers={n_gpu_layers}: {_gpu_absence()}; every layer runs on the CPU",
                          RuntimeWarning, stacklevel=2)
        self.n_vocab = Count(self._info["n_vocab"])
        self.input_ids: List[int] = []   # the tokens evaluated in the context, in order
        self._after_prompt = None        # called by generate() once the prompt is evaluated
        self._evaluating = False         # inside eval(): its progress function may call in

        if vocab_only:
            return
        for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise errors.InvalidArgumentError(f"{name} must be a non-negative integer, got {value!r}")
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise errors.InvalidArgumentError(f"n_threads must be a positive integer, got {n_threads!r}")
        budget_n, budget_frac = parse_budget(budget)
        if evict_every_chunk:   # a policy argument every evicting policy takes
            policy_kwargs = {**(policy_kwargs or {}), "evict_every_chunk": 1}
        args_text, probe = policy_args(policy_kwargs)
        self._policy_args_c = ffi.new("char[]", args_text.encode())
        self._policy_c = ffi.new("char[]", (policy or "full").encode())
        cparams = new_params("struct pykv_context_params", lib.pykv_context_default_params)
        cparams.n_ctx = n_ctx
        cparams.n_ubatch = n_ubatch if n_ubatch is not None else n_batch
        cparams.n_threads = n_threads or 0
        cparams.policy = self._policy_c
        cparams.budget = budget_n
        cparams.budget_frac = budget_frac
        cparams.window = -1 if window is None else window
        cparams.sink = -1 if sink is None else sink
        cparams.policy_args = self._policy_args_c if args_text else ffi.NULL
        cparams.exact_matmul = int(bool(exact_matmul))
        cparams.kv_type = _kv_type_code(kv_type)   # keys, and values unless kv_type_v (llama.cpp's -ctk, -ctv)
        cparams.kv_type_v = -1 if kv_type_v is None else _kv_type_code(kv_type_v, "kv_type_v")
        _llama_cpp_options.apply_kv_overrides(compat, self.metadata)
        if compat.rope_freq_base or compat.rope_freq_scale:   # else the defaults: the model's, unscaled
            if not hasattr(cparams, "rope_freq_base"):
                self.close()
                raise errors.InvalidArgumentError(
                    "rope_freq_base and rope_freq_scale need a libpykv with RoPE overrides; this one is older: "
                    "reinstall pykv (pip install .)")
            cparams.rope_freq_base = compat.rope_freq_base
            cparams.rope_freq_scale = compat.rope_freq_scale
        cout = ffi.new("pykv_context **")
        status = lib.pykv_context_init(self._model, cparams, cout)
        if status != lib.PYKV_OK:
            self.close()
            check(status)
        self._ctx = cout[0]
        self._relay_warnings(self._ctx)   # a context that keeps the GPU layers on the CPU says why
        self.n_threads = n_threads or _physical_cores()   # the count the C library uses for 0
        self.logits_all = bool(logits_all)
        self.embedding = bool(embedding)
        try:
            from ._embedding import pooling_name
            self.pooling_type = pooling_name(pooling_type, self.metadata) if embedding else None
        except Exception:
            self.close()
            raise
        check(lib.pykv_set_logits_all(self._ctx, int(self.logits_all)))
        check(lib.pykv_set_embeddings(self._ctx, int(self.embedding)))
        n_ctx_train = self._info.get("n_ctx_train") or 0
        if 0 < n_ctx_train < self.n_ctx:
            warnings.warn(f"n_ctx={self.n_ctx} is larger than the model's training context ({n_ctx_train} tokens): "
                          f"past position {n_ctx_train} the model runs on positions it never saw, and its "
                          "output may degrade", RuntimeWarning, stacklevel=2)
        if probe is not None:
            try:
                self.set_probe(probe)
            except Exception:
                self.close()
                raise

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str, **kwargs) -> "Llama":
        """llama-cpp-python's: a GGUF from a Hugging Face repository (downloaded once into
        huggingface-hub's cache), e.g. Llama.from_pretrained("owner/repo", "*q4_k_m.gguf").
        A filename with glob characters must match exactly one file of the repository;
        kwargs go to Llama()."""
        from .pull import hf_address
        return cls(hf_address(repo_id, filename), **kwargs)

    # ---- lifetime ----

    def _refuse_in_eval(self, what: str) -> None:
        # _evaluating is the holding thread's: another thread's call waits or is refused by _in_use
        if getattr(self, "_evaluating", False) and self._in_use.holds_context():
            raise errors.InvalidArgumentError(f"{what} cannot run inside eval() (from its progress callback)")

    def close(self) -> None:
        """Free the context and the model now (also done by `with` and on garbage collection).
        Any thread may call it: a call running in another thread (generate(), eval(), ...) is
        cancelled (it raises GenerationCancelled, or InvalidArgumentError "this Llama is
        closed" at its next step), and close() waits for it to stop before freeing anything;
        calls made afterwards raise InvalidArgumentError."""
        self._refuse_in_eval("close()")
        in_use = getattr(self, "_in_use", None)
        if in_use is None:   # __init__ did not get that far
            return
        if in_use.holds_context():
            raise errors.InvalidArgumentError("close() cannot run inside a call on this Llama (from one of its "
                                              "callbacks)")
        in_use.close(self._cancel_native, self._free_native)

    def _cancel_native(self) -> None:
        if self._ctx is not None:
            lib.pykv_cancel(self._ctx)

    def _free_native(self) -> None:
        if self._ctx is not None:
            lib.pykv_context_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            lib.pykv_model_free(self._model)
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _need_model(self):
        if self._model is None:
            raise errors.InvalidArgumentError("this Llama is closed")
        return self._model

    def _need_ctx(self):
        if self._ctx is None:
            raise errors.InvalidArgumentError(
                "this Llama is closed" if self._model is None else "the model was loaded with vocab_only=True")
        return self._ctx

    # ---- model facts ----

    def _read_info(self) -> dict:
        info = new_params("struct pykv_model_info")
        check(lib.pykv_model_get_info(self._model, info))
        names = ("n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim",
                 "n_ff", "rope_freq_base", "rms_eps", "tied_output", "n_params", "n_bytes",
                 "gguf_version", "vocab_only", "n_gpu_layers", "gpu_output", "gpu_device", "gpu_bytes")
        return {name: getattr(info, name) for name in names}

    @property
    def model_info(self) -> dict:
        return dict(self._info)

    @property
    @using_model
    def metadata(self) -> dict:
        model = self._need_model()
        result = {}
        for i in range(lib.pykv_model_meta_count(model)):
            key = call_string(lib.pykv_model_meta_key, model, i).decode("utf-8", "replace")
            result[key] = call_string(lib.pykv_model_meta_value, model, i).decode("utf-8", "replace")
        return result

    @property
    @using_model
    def tensors(self) -> List[dict]:
        model = self._need_model()
        info = new_params("struct pykv_tensor_info")
        rows = []
        for i in range(lib.pykv_model_tensor_count(model)):
            check(lib.pykv_model_tensor_info(model, i, info))
            type_name = lib.pykv_type_name(info.type)
            rows.append({
                "name": ffi.string(info.name).decode("utf-8", "replace"),
                "type": ffi.string(type_name).decode() if type_name != ffi.NULL else str(info.type),
                "shape": [info.ne[d] for d in range(info.n_dims)],
                "n_bytes": info.n_bytes,
            })
        return rows

    @property
    @using_model
    def chat_template(self) -> Optional[str]:
        """The chat template in use: the one given to the constructor, else the GGUF's (None: none)."""
        if self._chat_template is not None:
            return self._chat_template
        model = self._need_model()
        try:
            return call_string(lib.pykv_model_meta_string, model, b"tokenizer.chat_template").decode("utf-8", "replace")
        except errors.InvalidArgumentError:
            return None

    @using_model
    def token_bos(self) -> int:
        return lib.pykv_vocab_bos(self._need_model())

    @using_model
    def token_eos(self) -> int:
        return lib.pykv_vocab_eos(self._need_model())

    @using_model
    def is_eog(self, token: int) -> bool:
        return bool(lib.pykv_vocab_is_eog(self._need_model(), token))

    # ---- tokenizer ----

    @using_model
    def tokenize(self, text: Union[str, bytes], add_bos: bool = True, special: bool = False) -> List[int]:
        """Token ids of text. add_bos adds the model's BOS/EOS as its metadata asks;
        special parses special-token text such as "<|im_start|>" into those tokens."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cap = len(data) + 8
        tokens = ffi.new("pykv_token[]", cap)
        n_out = ffi.new("int32_t *")
        status = lib.pykv_tokenize(self._need_model(), data, len(data), int(add_bos), int(special), tokens, cap, n_out)
        if status == lib.PYKV_ERR_BUFFER_TOO_SMALL:
            cap = n_out[0]
            tokens = ffi.new("pykv_token[]", cap)
            status = lib.pykv_tokenize(self._model, data, len(data), int(add_bos), int(special), tokens, cap, n_out)
        check(status)
        return list(ffi.unpack(tokens, n_out[0]))

    @using_model
    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        arr = ffi.new("pykv_token[]", list(tokens))
        return call_string(lib.pykv_detokenize, self._need_model(), arr, len(tokens), int(special),
                           initial=16 * len(tokens) + 16)

    @using_model
    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return call_string(lib.pykv_token_to_piece, self._need_model(), token, int(special), initial=64)

    # ---- low-level loop ----

    @property
    @using_model   # fixed when the context is made
    def n_ctx(self) -> int:
        return Count(lib.pykv_n_ctx(self._need_ctx()))

    @property
    def n_embd(self) -> int:
        return Count(self._info["n_embd"])

    def set_seed(self, seed: int) -> None:
        """The seed of the generations that are given none (as the constructor's; -1: random)."""
        self._seed = seed
        self._rng = random.Random(None if seed is None or seed < 0 else seed)

    @property
    @using_context("in use")
    def n_past(self) -> int:
        return lib.pykv_n_past(self._need_ctx())

    n_tokens = n_past

    @using_context("evaluating")
    def eval(self, tokens: Sequence[int], progress: Optional[Callable[[int, int], object]] = None) -> None:
        """Append tokens to the context. Several tokens are a prefill (run in chunks of
        n_batch); one token is a decode step. progress(n_done, n_total) is called after each
        chunk of a prefill; returning False stops the call at the next chunk boundary, as
        cancel() does (GenerationCancelled). Python runs between the chunks either way, so
        Ctrl-C (KeyboardInterrupt), or an exception from progress, stops a long prefill there
        too and is raised once the call has stopped; the chunks done stay evaluated.
        A model file truncated since it was loaded (mapped) gives ModelLoadError (pykv._mapped_file)."""
        self._refuse_in_eval("eval()")
        tokens = list(tokens)
        ctx = self._need_ctx()
        if not tokens:
            return
        _mapped_file.check(self._mapped_file)
        arr = ffi.new("pykv_token[]", tokens)
        before = lib.pykv_n_past(ctx)
        outer, self._evaluating = self._evaluating, self._evaluating or len(tokens) > 1
        try:
            if len(tokens) == 1:
                status = lib.pykv_decode(ctx, arr, 1)
            else:
                status = _decode_in_steps(ctx, arr, len(tokens), progress)
        finally:   # the tokens evaluated, also when progress raised
            self._evaluating = outer
            n_new = lib.pykv_n_past(ctx) - before
            self.input_ids.extend(tokens[:n_new])
            self._record_scores(ctx, before, n_new)
            self._relay_warnings(ctx)
        check(status)

    @staticmethod
    def _relay_warnings(ctx) -> None:
        """The C context's warnings (a budget raised to the policy's floor or cut to n_ctx,
        positions past the training context), each given once per context, as RuntimeWarning."""
        take = _optional_lib_function("pykv_take_warning")
        while take is not None:
            text = take(ctx)
            if text == ffi.NULL:
                return
            warnings.warn(ffi.string(text).decode(errors="replace"), RuntimeWarning, stacklevel=4)

    @property
    def cache_bounded(self) -> bool:
        """True when n_ctx bounds the cache rather than the prompt: the policy evicts after
        every prefill chunk (take, or evict_every_chunk=True), so a prompt longer than n_ctx
        goes through, each (layer, KV head) holding at most n_ctx entries."""
        bounded = _optional_lib_function("pykv_cache_bounded")
        return bounded is not None and bool(bounded(self._need_ctx()))

    @using_context("in use")
    def set_probe(self, probe) -> None:
        """The task probe of chunked-prefill policies (TAKE) for the following eval() calls:
        text (tokenized without BOS, special tokens parsed) or token ids; None or empty
        goes back to the default (the last tokens of each prefill)."""
        if probe is None:
            tokens = []
        elif isinstance(probe, (str, bytes)):
            tokens = self.tokenize(probe, add_bos=False, special=True)
        else:
            tokens = [int(t) for t in probe]
        self._refuse_in_eval("set_probe()")
        arr = ffi.new("pykv_token[]", max(len(tokens), 1))
        arr[0:len(tokens)] = tokens
        check(lib.pykv_set_probe(self._need_ctx(), arr, len(tokens)))

    @using_context("in use")
    def logits(self) -> np.ndarray:
        """Logits of the last evaluated token, float32 (n_vocab,), a copy."""
        return self._last_logits()[1].copy()

    def _last_logits(self):
        """(C pointer, float32 view) of the last evaluated token's logits, valid until the next eval."""
        ptr = lib.pykv_get_logits(self._need_ctx())
        if ptr == ffi.NULL:
            raise errors.InvalidArgumentError("no logits yet: eval() some tokens first")
        return ptr, np.frombuffer(ffi.buffer(ptr, 4 * self.n_vocab), dtype=np.float32)

    def _rows(self, getter, width: int, what: str) -> np.ndarray:
        """The last call's rows in the context's memory (valid until the next eval or reset)."""
        n = ffi.new("int32_t *")
        ptr = getter(self._need_ctx(), n)
        if ptr == ffi.NULL:
            raise errors.InvalidArgumentError(f"no {what}: eval() some tokens first")
        return np.frombuffer(ffi.buffer(ptr, 4 * n[0] * width), dtype=np.float32).reshape(n[0], width)

    @using_context("in use")
    def all_logits(self) -> np.ndarray:
        """Logits of every token of the last eval() call, float32 (n_tokens, n_vocab), a copy;
        row i predicts the token after the call's token i. Needs Llama(logits_all=True)."""
        if not self.logits_all:
            raise errors.InvalidArgumentError("all_logits() needs a Llama created with logits_all=True")
        return self._rows(lib.pykv_get_logits_all, self.n_vocab, "logits").copy()

    @contextmanager
    def _keeping_all_logits(self):
        """Every token's logits kept for the eval() calls inside, whatever logits_all says;
        _rows(lib.pykv_get_logits_all, ...) reads them. The rows are gone after, unless
        logits_all is on."""
        ctx = self._need_ctx()
        if not self.logits_all:
            check(lib.pykv_set_logits_all(ctx, 1))
        try:
            yield
        finally:
            if not self.logits_all:
                lib.pykv_set_logits_all(ctx, 0)

    def _eval_logit_rows(self, tokens: List[int]) -> np.ndarray:
        """eval(tokens) and a view of their logits rows; inside _keeping_all_logits only."""
        self.eval(tokens)
        return self._rows(lib.pykv_get_logits_all, self.n_vocab, "logits")

    @using_context("in use")
    def embeddings(self) -> np.ndarray:
        """Hidden states (after the output norm) of every token of the last eval() call, float32
        (n_tokens, n_embd), a copy. Needs Llama(embedding=True)."""
        if not self.embedding:
            raise errors.InvalidArgumentError("embeddings() needs a Llama created with embedding=True")
        return self._rows(lib.pykv_get_embeddings, self._info["n_embd"], "embeddings").copy()

    @using_context("embedding")
    def embed(self, input, normalize: bool = False, truncate: bool = True, return_count: bool = False):
        """llama-cpp-python's embed: a text's embedding (a list of floats; with pooling_type
        'none' one list per token), or a list of them for a list of texts. Each text is run on
        its own from an empty context (its policy applies), cut to n_ctx tokens when truncate
        (else ContextOverflowError); normalize divides each vector by its Euclidean norm;
        return_count adds the number of tokens run. Needs Llama(embedding=True)."""
        from ._embedding import embed
        return embed(self, input, normalize, truncate, return_count)

    @using_context("embedding")
    def create_embedding(self, input, model: Optional[str] = None) -> dict:
        """The OpenAI-shaped embeddings dict for a text or a list of texts (see embed)."""
        from ._embedding import create_embedding
        return create_embedding(self, input, model)

    @using_context("in use")
    def reset(self) -> None:
        """Clear the context: every token and the KV cache's memory."""
        self._refuse_in_eval("reset()")
        lib.pykv_reset(self._need_ctx())
        self.input_ids = []

    @using_context("in use")
    def truncate(self, n_keep: int) -> None:
        """Forget the tokens after the first n_keep, so that eval() continues after them. Only
        the `full` policy allows it (an evicting policy's cache cannot be cut back to a prefix:
        InvalidArgumentError, whatever n_keep); n_keep=0 is reset()."""
        if not isinstance(n_keep, int) or isinstance(n_keep, bool):
            raise errors.InvalidArgumentError(f"n_keep must be an integer, got {n_keep!r}")
        self._refuse_in_eval("truncate()")
        ctx = self._need_ctx()
        status = lib.pykv_truncate(ctx, n_keep)
        del self.input_ids[lib.pykv_n_past(ctx):]   # what the context holds, whatever the status
        check(status)

    @using_context("in use")
    def save_state(self):
        """The context as it stands (tokens, their keys and values, the last logits, the
        policy's own state), as a LlamaState for load_state() of a Llama made with the same
        model, KV type, policy and policy settings. With an evicting policy the state holds
        the compressed cache: it is as small as the cache."""
        from ._state import save_state
        return save_state(self)

    @using_context("in use")
    def load_state(self, state) -> None:
        """Put back a state from save_state() of a Llama on the same model and KV type, with
        the same policy and settings (its n_ctx large enough): the context continues as the
        saved one would. A refused state leaves the context as it was."""
        self._refuse_in_eval("load_state()")
        from ._state import load_state
        load_state(self, state)

    def cancel(self) -> None:
        """Ask a running eval() (from another thread) to stop: it raises GenerationCancelled
        at the next layer, or with an evicting policy at the next chunk boundary (a decode
        step then finishes first). A cancel between two calls stops the next one before it
        evaluates anything; reset() (and so generate()) forgets a pending cancel."""
        self._in_use.unless_closing(self._cancel_native)   # a closing Llama cancels by itself

    @using_context("in use")
    def set_threads(self, n_threads: int) -> None:
        self._refuse_in_eval("set_threads()")
        check(lib.pykv_context_set_threads(self._need_ctx(), n_threads))
        self.n_threads = n_threads

    @using_context("in use")
    def kv_stats(self) -> dict:
        ctx = self._need_ctx()
        stats = new_params("struct pykv_kv_stats")
        check(lib.pykv_kv_stats(ctx, stats))
        kv_type, kv_type_v = _kv_type_name(stats.kv_type), _kv_type_name(stats.kv_type_v)
        return {
            "entries": stats.entries,
            "entries_per_head": [[lib.pykv_kv_head_entries(ctx, layer, head) for head in range(stats.n_head_kv)]
                                 for layer in range(stats.n_layer)],
            "bytes": stats.bytes,
            "device_bytes": stats.device_bytes,   # GPU memory of the offloaded layers' keys and values (in steps of 256 rows)
            "peak_bytes": stats.peak_bytes,
            "evicted": stats.evicted,
            "merged": stats.merged,
            "policy": ffi.string(stats.policy).decode(),
            "kv_type": kv_type,       # the keys'
            "kv_type_v": kv_type_v,   # the values'
            "bytes_per_element": (_KV_ELEMENT_BYTES[kv_type] + _KV_ELEMENT_BYTES[kv_type_v]) / 2,   # of K and V
        }

    @using_context("in use")
    def kv_positions(self, layer: int, head: int) -> List[int]:
        """Original positions of the entries resident in (layer, KV head), in cache order."""
        ctx = self._need_ctx()
        n = lib.pykv_kv_head_entries(ctx, layer, head)
        if n < 0:
            raise errors.InvalidArgumentError(f"no KV list for layer {layer}, head {head}")
        out = ffi.new("pykv_pos[]", max(n, 1))
        n_out = ffi.new("int32_t *")
        check(lib.pykv_kv_head_positions(ctx, layer, head, out, n, n_out))
        return list(ffi.unpack(out, n_out[0]))

    @using_context("in use")
    def timings(self) -> dict:
        """Tokens evaluated and milliseconds taken since the last generation began, split into
        the prompt's ("prompt_*") and the generated tokens' ("predicted_*"); a one-token
        prompt counts as the prompt's, though the C library times a one-token call as a
        decode step."""
        t = new_params("struct pykv_timings")
        lib.pykv_get_timings(self._need_ctx(), t)
        moved_n, moved_ms = getattr(self, "_prompt_step", (0, 0.0))
        n_prefill, ms_prefill = t.n_prefill + moved_n, t.t_prefill_ms + moved_ms
        n_decode, ms_decode = t.n_decode - moved_n, max(t.t_decode_ms - moved_ms, 0.0)
        return {
            "prompt_n": n_prefill,
            "prompt_ms": ms_prefill,
            "prompt_per_second": n_prefill / ms_prefill * 1e3 if ms_prefill > 0 else 0.0,
            "predicted_n": n_decode,
            "predicted_ms": ms_decode,
            "predicted_per_second": n_decode / ms_decode * 1e3 if ms_decode > 0 else 0.0,
        }

    def _reset_timings(self) -> None:
        lib.pykv_reset_timings(self._need_ctx())
        self._prompt_step = (0, 0.0)

    def _eval_prompt(self, tokens: Sequence[int], progress=None) -> None:
        """eval() of a prompt's tokens after _reset_timings(), timed as the prompt's however
        many they are (a one-token call is a decode step to the C library)."""
        tokens = list(tokens)
        if len(tokens) != 1:
            self.eval(tokens, progress=progress)
            return
        t = new_params("struct pykv_timings")
        lib.pykv_get_timings(self._need_ctx(), t)
        n0, ms0 = t.n_decode, t.t_decode_ms
        try:
            self.eval(tokens, progress=progress)
        finally:
            lib.pykv_get_timings(self._ctx, t)
            self._prompt_step = (t.n_decode - n0, t.t_decode_ms - ms0)

    # ---- llama-cpp-python's scores, eval_tokens and prompt caches ----

    @property
    def scores(self) -> np.ndarray:
        """llama-cpp-python's scores: float32 (n_ctx, n_vocab) with logits_all, else (n_batch,
        n_vocab). With logits_all, row i holds the logits computed at position i (those that
        predict token i + 1) for every position evaluated so far; rows of positions not
        evaluated (or past n_ctx) are zero or stale, and without logits_all none is filled,
        as in llama-cpp-python (logits() has the last token's). The array is the Llama's own,
        written by later evaluations."""
        if self._scores is None:
            rows = self.n_ctx if self.logits_all else self.n_batch
            self._scores = np.zeros((rows, self.n_vocab), dtype=np.float32)   # pages only as written
        return self._scores

    def _record_scores(self, ctx, first: int, n: int) -> None:
        """Copy the logits of the last eval()'s n tokens (at positions first..) into scores."""
        if not self.logits_all or n <= 0:
            return
        n_rows = ffi.new("int32_t *")
        ptr = lib.pykv_get_logits_all(ctx, n_rows)
        if ptr == ffi.NULL:
            return
        n = min(n, n_rows[0], max(self.n_ctx - first, 0))
        if n > 0:
            rows = np.frombuffer(ffi.buffer(ptr, 4 * n_rows[0] * self.n_vocab), dtype=np.float32)
            self.scores[first:first + n] = rows.reshape(n_rows[0], self.n_vocab)[:n]

    @property
    def eval_tokens(self) -> deque:
        """llama-cpp-python's: the tokens evaluated in the context, in order (at most n_ctx)."""
        return deque(self.input_ids, maxlen=int(self.n_ctx))

    @property
    def eval_logits(self) -> deque:
        """llama-cpp-python's: the scores rows of the evaluated tokens, as lists (with
        logits_all; without it the last row of scores only)."""
        n = len(self.input_ids)
        rows = self.scores[:min(n, self.scores.shape[0])]
        return deque(rows.tolist(), maxlen=int(self.n_ctx) if self.logits_all else 1)

    def set_cache(self, cache) -> None:
        """Keep each completion's state in cache (a pykv.LlamaRAMCache or LlamaDiskCache;
        None: no cache), to start later completions from the saved state whose tokens share
        the longest prefix with their prompt (see pykv.caches)."""
        from .caches import BaseLlamaCache
        if cache is not None and not isinstance(cache, BaseLlamaCache):
            raise errors.InvalidArgumentError(
                f"set_cache takes a LlamaRAMCache, a LlamaDiskCache or None, got {type(cache).__name__}")
        self.cache = cache

    def _model_id(self) -> str:
        if getattr(self, "_fingerprint", None) is None:
            from ._state import model_fingerprint
            self._fingerprint = model_fingerprint(self.model_path)
        return self._fingerprint

    def _load_from_cache(self, prompt_tokens: List[int]) -> None:
        """Load the cached state that shares a longer prefix with the prompt than the context
        does (llama-cpp-python's rule); a state this context cannot take is left alone."""
        if self.cache is None:
            return
        try:
            state = self.cache._lookup(prompt_tokens, self._model_id())
        except (OSError, ValueError):   # a disk cache's file gone or damaged meanwhile
            return
        if state is None:
            return
        if common_prefix(state.input_ids, prompt_tokens) > common_prefix(self.input_ids, prompt_tokens):
            try:
                self.load_state(state)
            except errors.PykvError:   # saved by a context of another KV type or policy
                pass

    def _save_to_cache(self, finish_reason: str) -> None:
        if self.cache is None or finish_reason == "cancelled":
            return
        try:
            self.cache._store(self.save_state(), self._model_id())
        except (errors.PykvError, OSError):   # closed meanwhile, or the disk cache cannot be written
            pass

    # ---- generation ----

    def _make_sampler(self, seed, **sampling):
        if seed is None or seed < 0:
            seed = self._rng.getrandbits(32) if self._seed is not None and self._seed >= 0 else lib.PYKV_DEFAULT_SEED
        return make_sampler(seed=seed, n_vocab=self.n_vocab, **sampling)

    def _prompt_tokens(self, prompt: Prompt) -> List[int]:
        """The prompt's token ids; InvalidArgumentError when there are none,
        ContextOverflowError when they do not fit the context."""
        if isinstance(prompt, (str, bytes)):
            tokens = self.tokenize(prompt, add_bos=True, special=True)
            if not tokens and not prompt and self.token_bos() >= 0:
                tokens = [self.token_bos()]   # as llama-cpp-python: an empty text starts from BOS
            elif not tokens:
                raise errors.InvalidArgumentError(
                    "the prompt is empty" if not prompt else
                    "the prompt has no tokens: none of its bytes has a token in this model's vocabulary")
        else:
            tokens = [int(t) for t in prompt]
            if not tokens:
                raise errors.InvalidArgumentError("the prompt is empty")
        if len(tokens) > self.n_ctx and not self.cache_bounded:
            raise errors.ContextOverflowError(
                f"the prompt has {len(tokens)} tokens, more than the context size n_ctx={self.n_ctx} (policy "
                f"'{self.kv_stats()['policy']}' keeps the whole prompt until its end; 'take', or another "
                "evicting policy with evict_every_chunk=True (--evict-every-chunk), reads longer prompts)")
        return tokens

    @using_context("generating")
    def generate(self, prompt: Prompt, max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                 seed: Optional[int] = None, stop: Union[None, str, Sequence[str]] = None,
                 ignore_eos: bool = False, stream: bool = False, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, logit_bias: Optional[dict] = None,
                 logprobs: Optional[int] = None, prompt_logprobs: Optional[int] = None,
                 grammar: Union[None, str, LlamaGrammar] = None, mirostat_mode: int = 0,
                 mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, typical_p: float = 1.0,
                 logits_processor=None, stopping_criteria=None, prompt_progress=None):
        """Generate text after prompt (text or token ids). With the `full` policy the context
        keeps the longest prefix of the prompt it already holds and evaluates the rest
        (result.cached_tokens); otherwise, or after reset(), it starts afresh, unless the context
        holds exactly the prompt from one eval() of it or a loaded state.

        max_tokens <= 0 or None generates until an end-of-generation token or a full context.
        The sampler is llama.cpp's chain: logit_bias ({token id: bias}, -inf bans), the repeat,
        frequency and presence penalties over the last repeat_last_n tokens, top-k, top-p,
        min-p, temperature; with mirostat_mode 1 or 2, Mirostat (mirostat_tau: target surprise
        in bits, mirostat_eta: learning rate) after the temperature instead of the filters.
        typical_p < 1 adds locally typical sampling after top-k.
        logprobs=N records each generated token's log-probability and the N most likely
        tokens at its step (result.logprobs, chunk.logprobs). prompt_logprobs=N
        does the same for the prompt's tokens (result.prompt_logprobs, on the first chunk when
        streaming); it evaluates the whole prompt, keeping every token's logits for the call
        (n_prompt x n_vocab floats). grammar (a LlamaGrammar or GBNF text) allows only tokens
        that continue a match of it, and the end of generation only after a complete one.
        logits_processor (a callable or a list, llama-cpp-python's LogitsProcessorList) maps
        (token ids so far, logits) to the scores the sampler then draws from; stopping_criteria
        (StoppingCriteriaList) is asked after each drawn token, with the ids including it and
        the logits it was drawn from: True ends the generation there (finish_reason "stop").
        prompt_progress(n_done, n_total) is called after each chunk of the prompt's evaluation
        (as eval()'s progress: False stops it).
        Returns a GenerationResult, or with stream=True an iterator of GenerationChunk whose
        final result is left in self.last_result."""
        from ._arguments import check_argument_types
        check_argument_types("generate", locals())
        self._need_ctx()
        if isinstance(stop, str):
            stop = [stop]
        tokens = self._prompt_tokens(prompt)
        sampler = self._make_sampler(seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                     logit_bias=logit_bias, mirostat_mode=mirostat_mode,
                                     mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, typical_p=typical_p)
        n_logprobs = check_n_logprobs(logprobs)
        n_prompt_logprobs = check_n_logprobs(prompt_logprobs, "prompt_logprobs")
        grammar = as_grammar(grammar)
        matcher = None if grammar is None else bind_grammar(self._model, grammar)
        callbacks = (as_callback(logits_processor, LogitsProcessorList, "logits_processor"),
                     as_callback(stopping_criteria, StoppingCriteriaList, "stopping_criteria"))
        steps = self._generate_steps(tokens, max_tokens, sampler, list(stop or []), ignore_eos, n_logprobs,
                                     n_prompt_logprobs, matcher, callbacks, prompt_progress)
        if stream:   # each step holds the context: another thread's call meanwhile is refused
            return hold_each_step(self._in_use, steps, "generating")
        for _ in steps:
            pass
        return self.last_result

    def _start_from(self, tokens: List[int]) -> int:
        """Make the context hold a prefix of tokens, ready to evaluate the rest: the longest
        one it already holds when the policy allows cutting back to it (`full`), else none.
        At least the last token is left to evaluate, for its logits, unless the context holds
        exactly these tokens and their logits as a fresh evaluation of them would leave them
        (a loaded state, an eval() of the prompt; with an evicting policy, one eval() of all of
        them). Returns the prefix's length (llama-cpp-python's prefix match)."""
        if (self.input_ids == tokens and lib.pykv_get_logits(self._ctx) != ffi.NULL
                and lib.pykv_is_single_run(self._ctx)):
            return len(tokens)
        keep = common_prefix(self.input_ids, tokens[:-1])
        if keep:
            try:
                self.truncate(keep)
                return keep
            except errors.InvalidArgumentError:   # an evicting policy: no cut
                pass
        self.reset()
        return 0

    def _eval_prompt_logprobs(self, tokens: List[int], n_top: int) -> List[Optional[TokenLogprob]]:
        """eval(tokens) on an empty context, keeping every row of logits for the call; the
        log-probability of each token after the first under the row before it."""
        with self._keeping_all_logits():
            rows = self._eval_logit_rows(tokens)
            return [None] + [token_logprob(rows[i - 1], tokens[i], n_top) for i in range(1, len(tokens))]

    def _draw(self, sampler, processor, ids):
        """(a token drawn by sampler from the last logits, after processor when given one, which
        sees ids(); those logits as they were, a view valid until the next eval)."""
        ptr, logits = self._last_logits()
        scores = ptr if processor is None else ffi.from_buffer("float[]", processed_logits(processor, ids(), logits))
        out = ffi.new("pykv_token *")
        check(lib.pykv_sampler_sample(sampler, scores, self.n_vocab, out))
        return out[0], logits

    @using_context("in use")
    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.8, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, logits_processor=None, seed: Optional[int] = None) -> int:
        """llama-cpp-python's low-level draw: a token from the last eval()'s logits under
        generate()'s chain, the penalties looking at the context's last last_n_tokens_size tokens. Each call
        starts a sampler afresh (Mirostat's state too); the token is not evaluated."""
        sampler = self._make_sampler(seed, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                     typical_p=typical_p, repeat_penalty=repeat_penalty,
                                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                     mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
        for t in self.input_ids[max(len(self.input_ids) - self.last_n_tokens_size, 0):]:
            lib.pykv_sampler_accept(sampler, t)
        processor = as_callback(logits_processor, LogitsProcessorList, "logits_processor")
        return self._draw(sampler, processor, lambda: np.array(self.input_ids, dtype=np.intc))[0]

    def _generate_steps(self, prompt_tokens, max_tokens, sampler, stop, ignore_eos, n_logprobs=None,
                        n_prompt_logprobs=None, grammar=None, callbacks=(None, None),
                        prompt_progress=None) -> Iterator[GenerationChunk]:
        if n_prompt_logprobs is None:
            self._load_from_cache(prompt_tokens)
            cached = self._start_from(prompt_tokens)
        else:   # every prompt token's logits are needed: none of it may come from the context
            self.reset()
            cached = 0
        self._reset_timings()
        after_prompt = self._after_prompt
        text = TextStream(stop)
        generated: List[int] = []
        logprobs = None if n_logprobs is None else []
        unsent = 0   # logprobs entries not yet attached to a chunk
        prompt_logprobs = unsent_prompt = None   # the prompt's, until a chunk carries them
        finish_reason = "length"
        limit = max_tokens if max_tokens and max_tokens > 0 else None
        processor, stopping = callbacks

        def ids():   # the callbacks' view: the prompt and the tokens generated so far
            return np.array(prompt_tokens + generated, dtype=np.intc)

        def chunk(piece, token):
            nonlocal unsent, unsent_prompt
            entries = None if logprobs is None else logprobs[unsent:]
            unsent = len(generated)
            out = GenerationChunk(piece, token, entries, unsent_prompt)
            unsent_prompt = None
            return out

        try:
            if n_prompt_logprobs is None:
                self._eval_prompt(prompt_tokens[cached:], progress=prompt_progress)
            else:
                prompt_logprobs = unsent_prompt = self._eval_prompt_logprobs(prompt_tokens, n_prompt_logprobs)
            if after_prompt is not None:
                after_prompt()
            for t in prompt_tokens:
                lib.pykv_sampler_accept(sampler, t)
            if grammar is not None:   # after the prompt: the grammar constrains generated text only
                check(lib.pykv_sampler_set_grammar(sampler, grammar))
            while limit is None or len(generated) < limit:
                token, logits = self._draw(sampler, processor, ids)
                if grammar is not None:
                    check(lib.pykv_grammar_accept(grammar, token))
                if not ignore_eos and self.is_eog(token):
                    finish_reason = "stop"
                    break
                lib.pykv_sampler_accept(sampler, token)
                generated.append(token)
                if logprobs is not None:
                    logprobs.append(token_logprob(logits, token, n_logprobs))
                piece = text.push(self.token_to_piece(token))
                if text.stopped_by is not None:
                    finish_reason = "stop"
                    if piece:
                        yield chunk(piece, token)
                    break
                if piece:
                    yield chunk(piece, token)
                if stopping is not None and stopping(ids(), logits.copy()):   # the ids include this token
                    finish_reason = "stop"
                    break
                if limit is not None and len(generated) >= limit:
                    break
                if self.n_past >= self.n_ctx and not self.cache_bounded:
                    break   # the context is full: finish_reason stays "length"
                try:
                    self.eval([token])
                except errors.ContextOverflowError:
                    if not self.cache_bounded:
                        raise
                    break   # the cache is full (nothing was evaluated): finish_reason stays "length"
        except (KeyboardInterrupt, errors.GenerationCancelled, GeneratorExit):
            finish_reason = "cancelled"
            # not when the collector closes a stream abandoned while the Llama was closed or
            # busy in another thread (pykv._in_use.hold_each_step): the context is not ours
            if self._in_use.holds_context():
                self._finish(text, generated, prompt_tokens, cached, finish_reason, logprobs, prompt_logprobs)
            raise
        tail = text.flush()
        if tail or (logprobs is not None and unsent < len(generated)) or unsent_prompt is not None:
            yield chunk(tail, generated[-1] if generated else -1)
        self._finish(text, generated, prompt_tokens, cached, finish_reason, logprobs, prompt_logprobs)

    def _finish(self, text, generated, prompt_tokens, cached, finish_reason, logprobs=None, prompt_logprobs=None):
        self._save_to_cache(finish_reason)
        self.last_result = GenerationResult(text=text.text, tokens=list(generated), finish_reason=finish_reason,
                                            prompt_tokens=len(prompt_tokens), cached_tokens=cached,
                                            timings=self.timings(), kv_stats=self.kv_stats(),
                                            logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    # ---- llama-cpp-python compatible completion ----

    @using_context("generating")
    def create_completion(self, prompt: Prompt, max_tokens: int = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                          repeat_penalty: float = 1.0, seed: Optional[int] = None,
                          stop: Union[None, str, Sequence[str]] = None, stream: bool = False,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                          logit_bias: Optional[dict] = None, logprobs: Optional[int] = None,
                          echo: bool = False, grammar: Union[None, str, LlamaGrammar] = None,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          typical_p: float = 1.0, logits_processor=None, stopping_criteria=None,
                          suffix: Optional[str] = None, prompt_progress=None, model: Optional[str] = None,
                          tfs_z: float = 1.0):
        """An OpenAI-shaped completion dict (or an iterator of chunk dicts with stream=True).
        logprobs=N fills each choice's "logprobs" (tokens, text_offset, token_logprobs and
        top_logprobs with the N most likely tokens and the chosen one), as llama-cpp-python.
        echo=True puts the prompt before the completion, and with logprobs its tokens' too
        (the first one's null, as OpenAI's): the whole prompt is then evaluated afresh.
        grammar, logits_processor and stopping_criteria work as in generate(). suffix fills in
        the middle: the completion is what goes between prompt and suffix (the model needs FIM
        tokens; see pykv.server.fim). prompt_progress works as in generate(). llama-cpp-python's
        model names the model in the result ("model"); tfs_z (tail-free sampling) is not
        implemented: other than 1.0 (off) it warns. The repeat, frequency and presence
        penalties look at the last last_n_tokens_size tokens (Llama's keyword, default 64)."""
        from ._arguments import check_argument_types
        check_argument_types("create_completion", locals())
        from .server.openai import completion
        if suffix is not None:
            if echo:
                raise errors.InvalidArgumentError("echo and suffix cannot go together")
            from .server.fim import infill_prompt
            prompt = infill_prompt(self, prompt, suffix)
        _check_tfs_z(tfs_z)
        return _named(model, completion(
                          self, prompt, stream, echo=echo, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=stop,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          logit_bias=logit_bias, logprobs=logprobs, grammar=grammar, mirostat_mode=mirostat_mode,
                          mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, typical_p=typical_p,
                          logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                          prompt_progress=prompt_progress, repeat_last_n=self.last_n_tokens_size))

    def chat_prompt(self, messages, add_generation_prompt: bool = True, tools=None) -> List[int]:
        """Token ids of messages rendered with the model's chat template (ChatML without one).
        tools (OpenAI's form) go to a template that reads them, or else are described in the
        system message (pykv.server.tools)."""
        from .server.tools import check_tools, prepare_messages, template_reads_tools
        from .chat import check_messages, render
        tools = check_tools(tools, None)
        template_tools = template_reads_tools(self.chat_template)
        messages = prepare_messages(check_messages(messages), tools, template_tools)
        extra = {"tools": tools} if tools is not None and template_tools else {}
        text = render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                      bos_token=self._special_text(self.token_bos()), eos_token=self._special_text(self.token_eos()),
                      **extra)
        tokens = self.tokenize(text, add_bos=True, special=True)
        bos = self.token_bos()
        if len(tokens) > 1 and tokens[0] == tokens[1] == bos:
            tokens = tokens[1:]   # the template wrote BOS itself: not twice
        return tokens

    def _special_text(self, token: int) -> str:
        return self.token_to_piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    @using_context("generating")
    def create_chat_completion(self, messages, temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, stream: bool = False, seed: Optional[int] = None,
                               stop: Union[None, str, Sequence[str]] = None, max_tokens: Optional[int] = None,
                               repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
                               presence_penalty: float = 0.0, logit_bias: Optional[dict] = None,
                               logprobs: bool = False, top_logprobs: Optional[int] = None,
                               response_format: Optional[dict] = None,
                               grammar: Union[None, str, LlamaGrammar] = None, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, typical_p: float = 1.0, tools=None,
                               tool_choice=None, functions=None, function_call=None, logits_processor=None,
                               stopping_criteria=None, prompt_progress=None, model: Optional[str] = None,
                               tfs_z: float = 1.0):
        """llama-cpp-python's chat completion: messages ([{"role", "content"}, ...]) rendered with
        the GGUF's chat template, an OpenAI-shaped "chat.completion" dict back (or its chunks with
        stream=True). max_tokens=None runs until end of generation or a full context.
        logprobs=True fills "logprobs": {"content": [{"token", "logprob", "bytes",
        "top_logprobs"}]} with top_logprobs alternatives per token.
        response_format {"type": "json_object"} makes the reply a JSON object, with "schema"
        (or {"type": "json_schema", "json_schema": {"schema": ...}}) one that schema allows;
        grammar (GBNF) constrains it otherwise. Not both.
        tools ([{"type": "function", "function": {"name", "description", "parameters"}}]) and
        tool_choice ("auto", the default with tools; "none"; "required"; or {"type": "function",
        "function": {"name": ...}}) let the model call functions: a call comes back in the
        message's "tool_calls" with finish_reason "tool_calls". "required" and a named function
        bind the reply to a call whose arguments follow the function's parameters schema. The
        older functions and function_call are taken too. See pykv.server.tools. logits_processor,
        stopping_criteria and prompt_progress work as in generate(); model and tfs_z and the
        penalties' window as in create_completion()."""
        from ._arguments import check_argument_types
        check_argument_types("create_chat_completion", locals())
        from .server.openai import chat_completion
        from .server.tools import check_tools, choose
        if top_logprobs is not None and not logprobs:
            raise errors.InvalidArgumentError("top_logprobs needs logprobs=True")
        if response_format is not None:
            if grammar is not None:
                raise errors.InvalidArgumentError("give response_format or grammar, not both")
            grammar = response_format_grammar(response_format)
        checked = check_tools(tools, functions)
        tool_mode, callable_tools = choose(checked, tool_choice, function_call)
        if tool_mode == "call":
            if grammar is not None:
                raise errors.InvalidArgumentError("a required tool call cannot take a grammar or response_format too")
            from .server.tools import call_grammar
            grammar = call_grammar(callable_tools)
        prompt = self.chat_prompt(messages, tools=checked)
        _check_tfs_z(tfs_z)
        return _named(model, chat_completion(
                               self, prompt, stream, tools=callable_tools, tool_mode=tool_mode,
                               legacy=functions is not None, max_tokens=max_tokens,
                               temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                               repeat_penalty=repeat_penalty, seed=seed, stop=stop,
                               frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                               logit_bias=logit_bias, logprobs=(top_logprobs or 0) if logprobs else None,
                               grammar=grammar, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                               mirostat_eta=mirostat_eta, typical_p=typical_p, logits_processor=logits_processor,
                               stopping_criteria=stopping_criteria, prompt_progress=prompt_progress,
                               repeat_last_n=self.last_n_tokens_size))

    __call__ = create_completion
