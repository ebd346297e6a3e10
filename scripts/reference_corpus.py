"""The reference model's corpus: Jane Austen's novels from Debian's ``r-cran-janeaustenr``, decoded without R.

The six novels sit in R's lazy-load database ``data/Rdata.rdb`` (indexed by ``Rdata.rdx``) as zlib-compressed R
serializations of character vectors, one element per printed line. :func:`read_r_lazyload` decodes them;
:func:`clean` turns printed lines into paragraphs. Used by ``scripts/train_reference_model.py``.
"""

from __future__ import annotations

import gzip
import re
import struct
import subprocess
import zlib
from pathlib import Path

TRAIN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility")
HELDOUT_NOVEL = "persuasion"
RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"


class _RUnserializer:
    """Reads R's XDR serialization format (versions 2 and 3), enough of it for data packages.

    Handles vectors (logical, integer, double, character, list), pairlists with tags and attributes, symbols,
    environments and references. Character vectors come back as lists of str (None for NA); a vector with a
    ``names`` attribute comes back as a dict.
    """

    _NIL_LIKE = {254, 253, 252, 251, 250, 242, 241}  # NILVALUE, GLOBALENV, UNBOUND, MISSINGARG, BASENS, (BASE/EMPTY)ENV

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError(f"not an XDR R serialization (starts with {data[:2]!r})")
        self._data = data
        self._pos = 2
        self._refs: list = []
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            n = self._int()
            self._pos += n  # native encoding name

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self._data, self._pos)
        self._pos += 4
        return value

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector
            n = (self._int() << 32) + self._int()
        return n

    def read(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in self._NIL_LIKE:
            return None
        if kind == 255:  # REFSXP
            index = flags >> 8 or self._int()
            return self._refs[index - 1]
        if kind == 1:  # SYMSXP
            symbol = ("symbol", self.read())
            self._refs.append(symbol)
            return symbol
        if kind in (247, 248, 249):  # PERSIST, PACKAGE, NAMESPACE: a string vector
            self._int()
            value = [self.read() for _ in range(self._int())]
            self._refs.append(value)
            return value
        if kind == 4:  # ENVSXP
            self._int()  # locked
            env: dict = {}
            self._refs.append(env)
            for part in ("enclos", "frame", "hashtab", "attributes"):
                env[part] = self.read()
            return env
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like cells
            if has_attr:
                self.read()
            tag = self.read() if has_tag else None
            cells = [(tag, self.read())]
            rest = self.read()
            return cells + rest if isinstance(rest, list) and rest and isinstance(rest[0], tuple) else cells
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            raw = self._data[self._pos : self._pos + n]
            self._pos += n
            return raw.decode("latin-1") if flags & (1 << 13) else raw.decode("utf-8")
        if kind == 238:  # ALTREP: class info, state, attributes
            self.read()
            state = self.read()
            self.read()
            return state
        if kind in (10, 13):
            n = self._length()
            value = list(struct.unpack_from(f">{n}i", self._data, self._pos))
            self._pos += 4 * n
        elif kind == 14:
            n = self._length()
            value = list(struct.unpack_from(f">{n}d", self._data, self._pos))
            self._pos += 8 * n
        elif kind in (16, 19, 20):
            value = [self.read() for _ in range(self._length())]
        else:
            raise ValueError(f"unsupported R SEXP type {kind} at byte {self._pos}")
        if has_attr:
            names = [v for tag, v in self.read() if tag == ("symbol", "names")]
            if names:
                return dict(zip(names[0], value, strict=True))
        return value


def read_r_lazyload(prefix: Path) -> dict:
    """All objects of an R lazy-load database ``prefix.rdb`` / ``prefix.rdx`` (zlib-compressed entries)."""
    index = _RUnserializer(gzip.decompress(prefix.with_suffix(".rdx").read_bytes())).read()
    if index.get("compressed", [True])[0] not in (True, 1):
        raise ValueError("only zlib-compressed lazy-load databases are supported")
    blob = prefix.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, size) in index["variables"].items():
        entry = blob[offset : offset + size]  # 4-byte big-endian raw length, then zlib data
        objects[name] = _RUnserializer(zlib.decompress(entry[4:])).read()
    return objects


def fetch_novels(deb: Path | None, work: Path) -> dict[str, list[str]]:
    """The six novels as lists of printed lines, from ``deb`` or a fresh ``apt-get download``."""
    work.mkdir(parents=True, exist_ok=True)
    if deb is None:
        subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=work, check=True, capture_output=True)
        deb = next(work.glob("r-cran-janeaustenr_*.deb"))
    unpacked = work / "unpacked"
    subprocess.run(["dpkg", "-x", str(deb), str(unpacked)], check=True)
    return read_r_lazyload(unpacked / RDATA)


def clean(lines: list[str]) -> str:
    """Printed lines to paragraphs separated by blank lines, without emphasis underscores."""
    paragraphs, current = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    text = "\n\n".join(paragraphs)
    text = text.replace("_", "")
    return re.sub(r"[ \t]+", " ", text) + "\n"
