"""llama-cpp-python's prompt caches: Llama.set_cache(LlamaRAMCache()) or LlamaDiskCache(dir)
keeps the context's state (Llama.save_state: tokens, keys, values, logits, the policy's own
state) after each completion, keyed by its tokens. A later completion whose prompt shares a
longer prefix with a saved state than with what the context holds starts from that state
(with the `full` policy the context then keeps that prefix and evaluates the rest; an
evicting policy uses a state only for exactly its tokens). When the saved states pass
capacity_bytes, the least recently used go first (the newest always stays).

    llm.set_cache(LlamaRAMCache(capacity_bytes=2 << 30))

The disk cache writes each state as a prompt-cache file (`pykv generate --prompt-cache`'s
format, pykv._state), named by a hash of its tokens, with the model's fingerprint: a state is
only offered to a Llama on the model it was saved from."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple

from . import errors
from ._state import FILE_MAGIC, LlamaState

Key = Tuple[int, ...]


def _key(tokens) -> Key:
    try:
        return tuple(int(t) for t in tokens)
    except (TypeError, ValueError):
        raise errors.InvalidArgumentError(f"a cache key is a sequence of token ids, got {tokens!r}") from None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _capacity(capacity_bytes) -> int:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
        raise errors.InvalidArgumentError(f"capacity_bytes must be an integer >= 0, got {capacity_bytes!r}")
    return capacity_bytes


class BaseLlamaCache:
    """Saved states keyed by their tokens. cache[tokens] is the state whose tokens share the
    longest prefix with tokens (KeyError when none shares any); `tokens in cache` says
    whether one does; cache[tokens] = state saves one."""

    def __init__(self, capacity_bytes: int = 2 << 30):
        self.capacity_bytes = _capacity(capacity_bytes)
        self.model: Optional[str] = None   # the model fingerprint of the states set (Llama.set_cache)

    @property
    def cache_size(self) -> int:
        """Bytes of the saved states."""
        raise NotImplementedError

    def _keys(self, model: Optional[str]) -> Iterable[Key]:
        raise NotImplementedError

    def _get(self, key: Key) -> LlamaState:
        raise NotImplementedError

    def _find_longest_prefix_key(self, key: Sequence[int], model: Optional[str] = None) -> Optional[Key]:
        best, best_n = None, 0
        for k in self._keys(model):
            n = common_prefix(k, key)
            if n > best_n:
                best, best_n = k, n
        return best

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        found = self._find_longest_prefix_key(_key(key), self.model)
        if found is None:
            raise KeyError("no saved state shares a prefix with these tokens")
        return self._get(found)

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find_longest_prefix_key(_key(key), self.model) is not None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        raise NotImplementedError

    def _lookup(self, tokens: Sequence[int], model: str) -> Optional[LlamaState]:
        """The state of model whose tokens share the longest prefix with tokens, or None."""
        found = self._find_longest_prefix_key(_key(tokens), model)
        return None if found is None else self._get(found)

    def _store(self, state: LlamaState, model: str) -> None:
        self.model = model
        self[state.input_ids] = state


def _state_bytes(state: LlamaState) -> int:
    return memoryview(state.data).nbytes


class LlamaRAMCache(BaseLlamaCache):
    """Saved states in this process's memory (a copy of each)."""

    def __init__(self, capacity_bytes: int = 2 << 30):
        super().__init__(capacity_bytes)
        self.cache_state: "OrderedDict[Key, Tuple[LlamaState, Optional[str]]]" = OrderedDict()

    @property
    def cache_size(self) -> int:
        return sum(_state_bytes(state) for state, _ in self.cache_state.values())

    def _keys(self, model):
        return [k for k, (_, m) in self.cache_state.items() if model is None or m is None or m == model]

    def _get(self, key: Key) -> LlamaState:
        self.cache_state.move_to_end(key)
        return self.cache_state[key][0]

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        if not isinstance(value, LlamaState):
            raise errors.InvalidArgumentError(f"a cache holds LlamaState values, got {type(value).__name__}")
        key = _key(key)
        self.cache_state.pop(key, None)
        self.cache_state[key] = (LlamaState(list(value.input_ids), bytes(value.data)), self.model)
        while len(self.cache_state) > 1 and self.cache_size > self.capacity_bytes:
            self.cache_state.popitem(last=False)


class LlamaDiskCache(BaseLlamaCache):
    """Saved states as files in cache_dir (made when missing), kept across processes."""

    def __init__(self, cache_dir: str = ".cache/llama_cache", capacity_bytes: int = 2 << 30):
        super().__init__(capacity_bytes)
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._index: dict = {}   # file name -> (tokens, model), read from the files' headers

    def _files(self):
        return sorted(self.cache_dir.glob("*.pykvstate"))

    def _header(self, path: Path):
        """(tokens, model) of a cache file, or None for a file that is not one."""
        stat = path.stat()
        cached = self._index.get(path.name)
        if cached is not None and cached[0] == (stat.st_size, stat.st_mtime_ns):
            return cached[1]
        try:
            with open(path, "rb") as f:
                head = f.read(len(FILE_MAGIC) + 4)
                if not head.startswith(FILE_MAGIC) or len(head) < len(FILE_MAGIC) + 4:
                    return None
                (n,) = struct.unpack_from("<I", head, len(FILE_MAGIC))
                header = json.loads(f.read(n))
            entry = (tuple(int(t) for t in header["tokens"]), header.get("model"))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._index[path.name] = ((stat.st_size, stat.st_mtime_ns), entry)
        return entry

    def _entries(self):
        for path in self._files():
            try:
                entry = self._header(path)
            except OSError:   # removed meanwhile
                continue
            if entry is not None:
                yield path, entry

    @property
    def cache_size(self) -> int:
        total = 0
        for path, _ in self._entries():
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def _keys(self, model):
        return [tokens for _, (tokens, m) in self._entries() if model is None or m is None or m == model]

    def _path(self, key: Key) -> Path:
        digest = hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:32]
        return self.cache_dir / f"{digest}.pykvstate"

    def _get(self, key: Key) -> LlamaState:
        path = self._path(key)
        data = path.read_bytes()
        (n,) = struct.unpack_from("<I", data, len(FILE_MAGIC))
        os.utime(path)   # recently used: evicted last
        return LlamaState(list(key), memoryview(data)[len(FILE_MAGIC) + 4 + n:])

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        if not isinstance(value, LlamaState):
            raise errors.InvalidArgumentError(f"a cache holds LlamaState values, got {type(value).__name__}")
        key = _key(key)
        header = json.dumps({"model": self.model, "tokens": list(key)}).encode()
        path = self._path(key)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(FILE_MAGIC + struct.pack("<I", len(header)) + header)
                f.write(value.data)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        now = time.time()
        os.utime(path, (now, now))
        self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        """The least recently used files go until the rest fit capacity_bytes (the newest stays)."""
        files = []
        for path in self._files():
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime_ns, st.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.capacity_bytes:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except OSError:
                pass
            self._index.pop(path.name, None)
            total -= size
