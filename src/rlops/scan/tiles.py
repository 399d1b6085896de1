"""Rows in SIMD lanes: the LLVM IR of the numba kernels' reverse scans (imported only when numba
is installed; docs/design/scan.md).

A kernel's group of :data:`WIDTH` rows runs as one vector per quantity, one lane per row,
walking back over tiles of 16 tokens. A tile's rows are loaded half a row at a time, two rows'
halves to a vector (the first round of the 8 x 8 transpose, done by the loads), and two rounds
of in-lane interleaves (:func:`transpose`) finish it (bfloat16 tiles, where the target has
AVX-512 BW: whole rows, and two rounds of two-source permutes, :func:`_pick`): the step at
token ``t0 + j`` then works
on the vector of all rows at ``t0 + j``. Outputs go back the same way. On long rows, row ``i``
walks its tiles ``i`` steps after row 0 (rows a power-of-two apart would otherwise share cache
sets). The tokens before the last whole tile (``T % 16`` of them, at a row's start) are
gathered and scattered one token at a time. Each lane does the very operations of the scalar
step it stands for, in the same order and dtypes (the float64 carry advanced by one fused
multiply-add), so a row's output bits do not depend on the rows beside it, on the group or on
the thread count.

:func:`reverse_scan` emits that loop for a ``step`` written with an IR builder (or a tile's
inputs and outputs made a row at a time, :class:`Rows`: float32 GAE without dones, with a mask
on the tiles where every token is an action token; a tile of mask-0 tokens alone stores zeros;
or on token pairs, :meth:`Group.load_pairs`: bfloat16 GAE's residuals and returns,
REINFORCE++'s rounded token rewards); :class:`Group` holds one group's row offsets and the
dtypes: bfloat16 arrays are their ``uint16`` bits, computed in float32 (a 32-bit word of two
tokens widened by a shift and a mask, two tokens to a vector of 16 lanes; stored rounded to
nearest even with a NaN the quiet NaN, as torch rounds a float32, by ``vcvtne2ps2bf16`` where
the target has it and the tile holds no NaN and no subnormal); bool arrays are bytes, turned
into lane masks without shuffles. :func:`gae` and :func:`reinforce` are the kernels.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from rlops.scan._cache import njit

__all__ = ["TOKENS", "WIDTH", "Group", "Rows", "gae", "reinforce", "reverse_scan"]

#: rows per group, one per vector lane
WIDTH = 8
#: tokens per tile: 64 bytes of a float32 row (a cache line), eight words of two bfloat16
TOKENS = 2 * WIDTH

F32, F64 = ir.FloatType(), ir.DoubleType()
I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))


def vector(t: ir.Type, w: int = WIDTH) -> ir.VectorType:
    return ir.VectorType(t, w)


def splat(value: ir.Constant, w: int = WIDTH) -> ir.Constant:
    """The constant ``value`` in every lane."""
    return ir.Constant(vector(value.type, w), [value] * w)


def constant(t: ir.Type, x) -> ir.Constant:
    """``x`` of type ``t`` in every lane."""
    return splat(ir.Constant(t, x))


def _size(ty) -> int:
    # bytes per element of a numba array type: the alignment of its loads and stores
    return 1 if ty.dtype == types.boolean else ty.dtype.bitwidth // 8


def _unpack(b: ir.IRBuilder, kind: str, x: ir.Value, y: ir.Value) -> ir.Value:
    # x86's in-lane interleaves ("lo32", "hi32", "lo64", "hi64") in each 128-bit lane (four
    # 32-bit lanes) of x and y, vectors of 8 or 16 lanes
    n, lanes = x.type.count, []
    for q in range(0, n, 4):
        a = q + (0 if kind.startswith("lo") else 2)
        pairs = kind.endswith("64")  # 64-bit lanes: two 32-bit lanes each
        lanes += [a, a + 1, n + a, n + a + 1] if pairs else [a, n + a, a + 1, n + a + 1]
    return b.shuffle_vector(x, y, ir.Constant(vector(I32, n), lanes))


def _transpose4(b: ir.IRBuilder, a: ir.Value, c: ir.Value, d: ir.Value, e: ir.Value) -> list:
    # the 4 x 4 blocks of four vectors' 128-bit lanes transposed (two rounds of interleaves)
    t0, t1 = _unpack(b, "lo32", a, c), _unpack(b, "hi32", a, c)
    t2, t3 = _unpack(b, "lo32", d, e), _unpack(b, "hi32", d, e)
    return [
        _unpack(b, "lo64", t0, t2),
        _unpack(b, "hi64", t0, t2),
        _unpack(b, "lo64", t1, t3),
        _unpack(b, "hi64", t1, t3),
    ]


def transpose(b: ir.IRBuilder, xs: list) -> list:
    """The 4 x 4 blocks in each half of the vectors ``xs`` (eight of 8 lanes, as
    :meth:`Group.load` reads a tile: vector ``i`` holds the first four tokens of rows ``i`` and
    ``i + 4``, vector ``i + 4`` their last four) transposed: vector ``j`` then holds the eight
    rows' token ``j``. Its own inverse. Two rounds of in-lane interleaves, the shuffles x86 runs
    in one instruction each; the swap of halves is done by the half-row loads and stores."""
    return _transpose4(b, *xs[0:4]) + _transpose4(b, *xs[4:8])


def widen_bf16(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``<W x i16>`` bfloat16 bits to the float32 values they stand for (exact)."""
    w = x.type.count
    return b.bitcast(
        b.shl(b.zext(x, vector(I32, w)), splat(ir.Constant(I32, 16), w)), vector(F32, w)
    )


def _bf16_high(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    # <W x float> to <W x i32> holding x's bfloat16 bits (to nearest even, a NaN the quiet
    # NaN) in its high half, zeros in its low half
    w = x.type.count
    u = b.bitcast(x, vector(I32, w))
    odd = b.and_(b.lshr(u, splat(ir.Constant(I32, 16), w)), splat(ir.Constant(I32, 1), w))
    up = b.add(b.add(u, splat(ir.Constant(I32, 0x7FFF), w)), odd)
    up = b.and_(up, splat(ir.Constant(I32, 0xFFFF0000), w))
    return b.select(b.fcmp_unordered("uno", x, x), splat(ir.Constant(I32, 0x7FC00000), w), up)


def round_bf16(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``<W x float>`` to bfloat16 bits ``<W x i16>``: to nearest even, a NaN the quiet NaN."""
    w = x.type.count
    return b.trunc(b.lshr(_bf16_high(b, x), splat(ir.Constant(I32, 16), w)), vector(I16, w))


def rounded_bf16(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``x`` (float32 lanes) rounded to bfloat16 and back: what a float32 op returning bfloat16
    gives."""
    return widen_bf16(b, round_bf16(b, x))


class _BFloat(ir.types.Type):
    # LLVM's bfloat (llvmlite's IR builder has no such type): the AVX-512 BF16 conversions'
    # results, bitcast at once to their i16 bits
    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _features(context) -> list:
    # the target's features as numba compiles for it ("+avx512f", ...; none where this numba
    # has no such method)
    try:
        return context.codegen()._get_host_cpu_features().split(",")
    except Exception:
        return []


def native_bf16(context) -> bool:
    """Whether the target numba compiles for has AVX-512 BF16 (``vcvtne2ps2bf16``) and DQ
    (``vfpclassps``): bfloat16 tiles are then stored rounded by the former (numba's disk cache
    keys its machine code by the target's features)."""
    features = _features(context)
    return all(f"+avx512{f}" in features for f in ("bf16", "vl", "bw", "dq"))


def permutes(context) -> bool:
    """Whether the target has AVX-512 F and BW: a shuffle of two vectors' 32-bit (16-bit)
    lanes into any order is one instruction there (``vpermt2d``, ``vpermt2w``), and bfloat16
    tiles are loaded and stored a whole row at a time (:func:`_pick`)."""
    features = _features(context)
    return "+avx512f" in features and "+avx512bw" in features


_NAN_OR_SUBNORMAL = 0x01 | 0x20 | 0x80  # vfpclassps: a quiet NaN, a subnormal, a signalling NaN


def _special(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    # lanes of <W x float> x that are NaN or subnormal (<W x i1>), by vfpclassps
    w = x.type.count
    fn = cgutils.get_or_insert_function(
        b.module,
        ir.FunctionType(vector(I1, w), [x.type, I32]),
        f"llvm.x86.avx512.fpclass.ps.{32 * w}",
    )
    return b.call(fn, [x, ir.Constant(I32, _NAN_OR_SUBNORMAL)])


def _halves_native(b: ir.IRBuilder, e: ir.Value, o: ir.Value) -> ir.Value:
    # <2W x i16>: bfloat16(e) in the low half, bfloat16(o) in the high half, by
    # vcvtne2ps2bf16: to nearest even as torch rounds, for every float32 but a NaN or a
    # subnormal (it gives the NaN's own bits, and flushes subnormals to zero): the callers take
    # those tiles the integer way
    w = e.type.count
    fn = cgutils.get_or_insert_function(
        b.module,
        ir.FunctionType(vector(_BFloat(), 2 * w), [e.type, o.type]),
        f"llvm.x86.avx512bf16.cvtne2ps2bf16.{32 * w}",
    )
    return b.bitcast(b.call(fn, [o, e]), vector(I16, 2 * w))


def _pick(b: ir.IRBuilder, x: ir.Value, y: ir.Value, at: tuple, keys: list) -> tuple:
    """The lanes of ``x`` and ``y`` holding ``keys``, in that order (one shuffle of two
    vectors; ``at``: for each, where a key is), and where each key is then."""
    n, (at_x, at_y) = x.type.count, at
    lanes = [at_x[k] if k in at_x else n + at_y[k] for k in keys]
    shuffled = b.shuffle_vector(x, y, ir.Constant(vector(I32, len(keys)), lanes))
    return shuffled, {k: i for i, k in enumerate(keys)}


def _rows_to_words(b: ir.IRBuilder, rows: list) -> list:
    """A bfloat16 tile's :data:`WIDTH` rows as ``<W x i32>`` words (word ``w``: the row's
    tokens ``2w`` and ``2w + 1``) to the words :meth:`Group.load_pairs` widens (vector ``j``:
    word ``j`` of each row, then word ``j + 4``): rows paired by the loads, then two rounds of
    two-source shuffles (``vpermt2d``); keys are ``(row, word)``."""
    h = WIDTH // 2
    pairs = [(_concat(b, rows[2 * k], rows[2 * k + 1]),
              {(2 * k + s, w): WIDTH * s + w for s in (0, 1) for w in range(WIDTH)})
             for k in range(h)]  # fmt: skip
    first = []  # per four rows: their words {0, 1, 4, 5}, then {2, 3, 6, 7}
    for q in range(2):
        (x, at_x), (y, at_y) = pairs[2 * q], pairs[2 * q + 1]
        first.append(
            [
                _pick(b, x, y, (at_x, at_y), [(h * q + r, w) for w in ws for r in range(h)])
                for ws in ((0, 1, h, h + 1), (2, 3, h + 2, h + 3))
            ]
        )
    out = []
    for j in range(h):
        (x, at_x), (y, at_y) = first[0][j // 2], first[1][j // 2]
        keys = [(r, j) for r in range(WIDTH)] + [(r, j + h) for r in range(WIDTH)]
        out.append(_pick(b, x, y, (at_x, at_y), keys)[0])
    return out


def _to_rows(b: ir.IRBuilder, xs: list, at: list, per_row: int) -> list:
    """Four vectors of a tile's values, ``at[j]`` where each ``(row, k)`` is in ``xs[j]``
    (``k`` < ``per_row``), as four vectors of two whole rows each (rows 2i, then 2i + 1, each
    ``k`` in order): two rounds of two-source shuffles, each first joining the values of rows
    0-3 (4-7) in ``xs[0]`` and ``xs[1]`` (``xs[2]``, ``xs[3]``)."""
    h = WIDTH // 2
    first = []
    for q in range(2):
        rows = range(h * q, h * q + h)
        joined = []
        for s in (0, 1):
            at_x, at_y = at[2 * s], at[2 * s + 1]
            ks = sorted({k for (r, k) in (*at_x, *at_y) if r == 0})
            joined.append(_pick(b, xs[2 * s], xs[2 * s + 1], (at_x, at_y),
                                [(r, k) for r in rows for k in ks]))  # fmt: skip
        first.append(joined)
    out = []
    for i in range(h):
        (x, at_x), (y, at_y) = first[i // 2]
        keys = [(2 * i + s, k) for s in (0, 1) for k in range(per_row)]
        out.append(_pick(b, x, y, (at_x, at_y), keys)[0])
    return out


def _rows_to_tokens(b: ir.IRBuilder, rows: list) -> list:
    """:data:`WIDTH` row vectors of :data:`TOKENS` lanes to :data:`TOKENS` token vectors of
    :data:`WIDTH` lanes (lane ``i`` of vector ``j``: row ``i``'s token ``j``)."""
    h, out = WIDTH // 2, []
    for part in range(0, TOKENS, WIDTH):
        first = list(range(part, part + h))
        second = list(range(part + h, part + WIDTH))
        xs = [None] * WIDTH
        for i in range(h):  # the layout transpose() takes: the half-row loads' round done
            for k, lanes in ((0, first), (1, second)):
                mask = ir.Constant(vector(I32), lanes + [TOKENS + j for j in lanes])
                xs[i + k * h] = b.shuffle_vector(rows[i], rows[i + h], mask)
        out += transpose(b, xs)
    return out


def _tokens_to_rows(b: ir.IRBuilder, tokens: list) -> list:
    """The inverse of :func:`_rows_to_tokens`."""
    h = WIDTH // 2
    halves = [transpose(b, tokens[part : part + WIDTH]) for part in range(0, TOKENS, WIDTH)]
    rows = [None] * WIDTH
    for i in range(h):
        for r, pick in ((i, 0), (i + h, h)):  # row i: lanes 0-3 of ws[i], ws[i + h]; i + h: 4-7
            pieces = []
            for ws in halves:
                pieces += [_sub(b, ws[i], pick, h), _sub(b, ws[i + h], pick, h)]
            quarter = [_concat(b, pieces[0], pieces[1]), _concat(b, pieces[2], pieces[3])]
            rows[r] = _concat(b, *quarter)
    return rows


def _sub(b: ir.IRBuilder, x: ir.Value, first: int, n: int) -> ir.Value:
    # lanes first .. first + n - 1 of x
    lanes = ir.Constant(vector(I32, n), list(range(first, first + n)))
    return b.shuffle_vector(x, ir.Constant(x.type, ir.Undefined), lanes)


def _concat(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    # the lanes of x, then those of y
    n = x.type.count + y.type.count
    return b.shuffle_vector(x, y, ir.Constant(vector(I32, n), list(range(n))))


def _pairs_to_tokens(b: ir.IRBuilder, evens: list, odds: list) -> list:
    """:meth:`Group.load_pairs`'s vectors as :data:`TOKENS` token vectors of :data:`WIDTH`
    lanes (the low halves free, the high ones one extract each)."""
    out = [None] * TOKENS
    half = TOKENS // 2
    for j, (e, o) in enumerate(zip(evens, odds, strict=True)):
        out[2 * j], out[2 * j + half] = _sub(b, e, 0, WIDTH), _sub(b, e, WIDTH, WIDTH)
        out[2 * j + 1], out[2 * j + 1 + half] = _sub(b, o, 0, WIDTH), _sub(b, o, WIDTH, WIDTH)
    return out


def _tokens_to_pairs(b: ir.IRBuilder, tokens: list) -> tuple[list, list]:
    """The inverse of :func:`_pairs_to_tokens`."""
    half = TOKENS // 2
    evens = [_concat(b, tokens[2 * j], tokens[2 * j + half]) for j in range(half // 2)]
    odds = [_concat(b, tokens[2 * j + 1], tokens[2 * j + 1 + half]) for j in range(half // 2)]
    return evens, odds


def _words(b: ir.IRBuilder, e: ir.Value, o: ir.Value) -> ir.Value:
    # <W x i32> words of bfloat16(e) | bfloat16(o) << 16, rounded by integer operations
    w = e.type.count
    low = b.lshr(_bf16_high(b, e), splat(ir.Constant(I32, 16), w))
    return b.or_(low, _bf16_high(b, o))


class Group:
    """One group of :data:`WIDTH` rows of ``[N, T]`` C-contiguous arrays: rows ``WIDTH * k``
    on, a short last group repeating row ``N - 1`` (the same values written twice), walked
    back in tiles of :data:`TOKENS` tokens."""

    def __init__(self, context, b, n: ir.Value, t_len: ir.Value, k: ir.Value):
        self.context, self.b, self.t_len = context, b, t_len
        last = b.sub(n, ir.Constant(I64, 1))
        first = b.mul(k, ir.Constant(I64, WIDTH))
        self.rows = []
        for i in range(WIDTH):
            row = b.add(first, ir.Constant(I64, i))
            self.rows.append(b.select(b.icmp_signed("<", row, last), row, last))
        self.offsets = [b.mul(row, t_len) for row in self.rows]
        #: bfloat16 stored by vcvtne2ps2bf16 where it gives torch's bits (:func:`native_bf16`)
        self.native = native_bf16(context)
        #: bfloat16 tiles loaded and stored a whole row at a time (:func:`permutes`)
        self.permutes = permutes(context)
        #: per row, whether its stores go to the arrays (None: every row's do)
        self.active: list | None = None
        #: where the other rows' stores go (64 bytes, never read)
        self.scratch = cgutils.alloca_once(b, ir.ArrayType(I8, 64))
        #: a bool tile's lane masks each from a byte of its words (a shift and a move to a mask
        #: register, at its use), else shifts of one 64-lane mask: the former 6-13% faster in
        #: bfloat16 GAE with a random mask (fewer masks spilled), REINFORCE++ 1-4%; 0-7% slower
        #: in the float32 kernels (8 x 131072, this VM)
        self.byte_masks = False

    def data(self, arr: tuple) -> ir.Value:
        """The data pointer of ``arr``, a ``(numba type, value)`` pair."""
        ty, value = arr
        return self.context.make_array(ty)(self.context, self.b, value).data

    def lanes(self, arr: tuple) -> ir.Value:
        """``[x[row] for row in rows]`` of a 1-D array, in its dtype."""
        b, data = self.b, self.data(arr)
        out = ir.Constant(vector(data.type.pointee), ir.Undefined)
        for i, row in enumerate(self.rows):
            out = b.insert_element(out, b.load(b.gep(data, [row])), ir.Constant(I32, i))
        return out

    def _arith(self, ty, x: ir.Value) -> ir.Value:
        # loaded lanes as computed: bfloat16 bits widened, bools as i1
        if ty.dtype == types.uint16:
            return widen_bf16(self.b, x)
        if ty.dtype == types.boolean:
            return self.b.icmp_unsigned("!=", x, ir.Constant(x.type, None))
        return x

    def _halves(self, data: ir.Value, lane: ir.Type, span: int, t0: list) -> list:
        # The pointers of a tile's half rows, [[row i, first half], [row i, second half]] per
        # row, row i's tile from token t0[i]: ``span`` elements of data per lane of type
        # ``lane`` (2 for bfloat16 words)
        b, h = self.b, WIDTH // 2
        out = []
        for off, t in zip(self.offsets, t0, strict=True):
            at = [b.add(off, b.add(t, ir.Constant(I64, k * h * span))) for k in (0, 1)]
            out.append([b.bitcast(b.gep(data, [a]), vector(lane, h).as_pointer()) for a in at])
        return out

    def _load_rows(self, data: ir.Value, lane: ir.Type, span: int, t0: list, align: int):
        # The WIDTH rows of a tile after the transpose's round of halves: vector i holds the
        # first halves of rows i and i + W/2, vector i + W/2 their second halves
        h = WIDTH // 2
        ptr = self._halves(data, lane, span, t0)
        ys = [None] * WIDTH
        for i in range(h):
            for k in (0, 1):
                lo, hi = (self.b.load(ptr[r][k], align=align) for r in (i, i + h))
                ys[i + k * h] = _concat(self.b, lo, hi)
        return ys

    def _store_rows(self, data, lane: ir.Type, span: int, t0: list, ws: list, align: int):
        # the inverse of _load_rows: store vectors laid out as it returns them; the rows not
        # :attr:`active` store into :attr:`scratch` instead
        b, h = self.b, WIDTH // 2
        ptr = self._halves(data, lane, span, t0)
        if self.active is not None:
            ptr = [
                [b.select(on, p, b.bitcast(self.scratch, p.type)) for p in row]
                for on, row in zip(self.active, ptr, strict=True)
            ]
        for i in range(h):
            for k in (0, 1):
                w = ws[i + k * h]
                b.store(_sub(b, w, 0, h), ptr[i][k], align=align)
                b.store(_sub(b, w, h, h), ptr[i + h][k], align=align)

    def _at(self, t0: list, part: int) -> list:
        return [self.b.add(t, ir.Constant(I64, part)) for t in t0]

    def load(self, arr: tuple, t0: list) -> list:
        """:data:`TOKENS` vectors: lane ``i`` of the ``j``-th holds row ``i``'s token
        ``t0[i] + j``."""
        b, data, ty = self.b, self.data(arr), arr[0]
        if ty.dtype == types.uint16:
            return _pairs_to_tokens(b, *self.load_pairs(arr, t0))
        if ty.dtype == types.boolean:
            return self._bools(data, t0)
        out = []
        for part in range(0, TOKENS, WIDTH):  # one WIDTH x WIDTH tile at a time
            rows = self._load_rows(data, data.type.pointee, 1, self._at(t0, part), _size(ty))
            out += transpose(b, rows)
        return out

    def store(self, arr: tuple, t0: list, xs: list) -> None:
        """Store the vectors ``xs`` (lane ``i`` of ``xs[j]`` row ``i``'s token ``t0[i] + j``)
        into ``arr``, for the rows :attr:`active` (every row where it is None)."""
        b, data, ty = self.b, self.data(arr), arr[0]
        if ty.dtype == types.uint16:
            self.store_pairs(arr, t0, *_tokens_to_pairs(b, xs))
            return
        for part in range(0, TOKENS, WIDTH):
            ws = transpose(b, xs[part : part + WIDTH])
            self._store_rows(data, data.type.pointee, 1, self._at(t0, part), ws, _size(ty))

    def load_pairs(self, arr: tuple, t0: list) -> tuple[list, list]:
        """A bfloat16 tile (``arr`` its ``uint16`` bits) as two lists of
        :data:`TOKENS` ``// 4`` float32 vectors of ``2 * WIDTH`` lanes, ``evens[j]`` the rows'
        tokens ``2j`` then ``2j + 8``, ``odds[j]`` tokens ``2j + 1`` then ``2j + 9`` (lane ``i``
        of each half: row ``i``). A row's 32-bit words hold two tokens, the even one in the low
        half: the words' 8 x 8 transpose runs on the two halves at once, and a shift and a mask
        widen them, no other shuffle."""
        b, data, h = self.b, self.data(arr), WIDTH // 2
        assert arr[0].dtype == types.uint16, arr[0]
        if self.permutes:  # whole rows, the words' transpose by two rounds of vpermt2d
            rows = []
            for off, t in zip(self.offsets, t0, strict=True):
                p = b.bitcast(b.gep(data, [b.add(off, t)]), vector(I32).as_pointer())
                rows.append(b.load(p, align=2))
            words = _rows_to_words(b, rows)
        else:
            ys = self._load_rows(data, I32, 2, t0, 2)
            words = _transpose4(b, *(_concat(b, ys[i], ys[i + h]) for i in range(h)))
        w = 2 * WIDTH
        low, high = splat(ir.Constant(I32, 16), w), splat(ir.Constant(I32, 0xFFFF0000), w)
        evens = [b.bitcast(b.shl(x, low), vector(F32, w)) for x in words]
        odds = [b.bitcast(b.and_(x, high), vector(F32, w)) for x in words]
        return evens, odds

    def store_pairs(self, arr: tuple, t0: list, evens: list, odds: list) -> None:
        """Store float32 vectors laid out as :meth:`load_pairs` gives them into the bfloat16
        ``arr``, each rounded once as torch rounds (to nearest even, a NaN the quiet NaN), for
        the rows :attr:`active`."""
        b, data = self.b, self.data(arr)
        pairs = list(zip(evens, odds, strict=True))
        if not self.native:
            self._store_words(data, t0, [_words(b, e, o) for e, o in pairs])
            return
        # vcvtne2ps2bf16 on tiles with no NaN and no subnormal (each branch transposes and
        # stores its own words: 5-9% faster than one store of the words' phi on this VM)
        special = None
        for x in evens + odds:
            lanes = _special(b, x)
            special = lanes if special is None else b.or_(special, lanes)
        odd = b.icmp_unsigned("!=", b.bitcast(special, I16), ir.Constant(I16, 0))
        with b.if_else(odd, likely=False) as (slow, fast):
            with slow:
                self._store_words(data, t0, [_words(b, e, o) for e, o in pairs])
            with fast:  # (native implies the permutes) the rounded halves' 16-bit transpose
                halves = [_halves_native(b, e, o) for e, o in pairs]
                at = [
                    {(r, 2 * j + s + WIDTH * k): 2 * WIDTH * s + WIDTH * k + r
                     for s in (0, 1) for k in (0, 1) for r in range(WIDTH)}
                    for j in range(len(pairs))
                ]  # fmt: skip
                self._store_whole_rows(data, t0, _to_rows(b, halves, at, TOKENS))

    def _store_words(self, data: ir.Value, t0: list, words: list) -> None:
        # the inverse of load_pairs's transpose, then the stores
        b = self.b
        if self.permutes:
            h = WIDTH // 2
            at = [
                {(r, j + h * k): WIDTH * k + r for k in (0, 1) for r in range(WIDTH)}
                for j in range(h)
            ]
            self._store_whole_rows(data, t0, _to_rows(b, words, at, WIDTH))
            return
        out = _transpose4(b, *words)
        ws = [_sub(b, x, 0, WIDTH) for x in out] + [_sub(b, x, WIDTH, WIDTH) for x in out]
        self._store_rows(data, I32, 2, t0, ws, 2)

    def _store_whole_rows(self, data: ir.Value, t0: list, twos: list) -> None:
        # vectors of two whole rows each (rows 2i, 2i + 1) stored a row at a time, for the rows
        # :attr:`active` (the others' to :attr:`scratch`)
        b = self.b
        for i, two in enumerate(twos):
            n = two.type.count // 2
            for s in (0, 1):
                r = 2 * i + s
                row = _sub(b, two, n * s, n)
                p = b.bitcast(b.gep(data, [b.add(self.offsets[r], t0[r])]), row.type.as_pointer())
                if self.active is not None:
                    p = b.select(self.active[r], p, b.bitcast(self.scratch, p.type))
                b.store(row, p, align=2)

    def rows_of(self, arr: tuple, t0: list) -> list:
        """Row ``i``'s tokens ``t0[i]`` to ``t0[i] + 15`` as one vector each (a float array's:
        bfloat16 takes the token tiles, :class:`Rows`)."""
        b, data, ty = self.b, self.data(arr), arr[0]
        assert ty.dtype in (types.float32, types.float64), ty
        out = []
        for off, t in zip(self.offsets, t0, strict=True):
            row = vector(data.type.pointee, TOKENS).as_pointer()
            out.append(b.load(b.bitcast(b.gep(data, [b.add(off, t)]), row), align=_size(ty)))
        return out

    def store_rows(self, arr: tuple, t0: list, rows: list) -> None:
        """Store row vectors (as :meth:`rows_of` gives them) into ``arr``, for the rows
        :attr:`active`."""
        b, data, ty = self.b, self.data(arr), arr[0]
        assert ty.dtype in (types.float32, types.float64), ty
        for i, (off, t, row) in enumerate(zip(self.offsets, t0, rows, strict=True)):
            p = b.bitcast(b.gep(data, [b.add(off, t)]), row.type.as_pointer())
            if self.active is not None:
                p = b.select(self.active[i], p, b.bitcast(self.scratch, p.type))
            b.store(row, p, align=_size(ty))

    def store_zeros(self, arr: tuple, t0: list) -> None:
        """Store +0.0 (all bits 0) into each row's tile of ``arr`` (every row's)."""
        b, data, ty = self.b, self.data(arr), arr[0]
        row = ir.ArrayType(I8, TOKENS * _size(ty))
        for off, t in zip(self.offsets, t0, strict=True):
            p = b.bitcast(b.gep(data, [b.add(off, t)]), row.as_pointer())
            b.store(ir.Constant(row, None), p, align=_size(ty))

    def _bools(self, data: ir.Value, t0: list) -> list:
        # A bool tile without shuffles: one lane mask a token from :meth:`mask_words`
        b = self.b
        out = []
        for word in self.mask_words(data, t0):
            if self.byte_masks:
                for j in range(8):  # byte j: the token's lanes
                    byte = b.trunc(b.lshr(word, ir.Constant(I64, 8 * j)), I8)
                    out.append(b.bitcast(byte, vector(I1)))
                continue
            bits = b.bitcast(word, vector(I1, 64))  # one 64-lane mask, 8 lanes a token
            for j in range(8):
                lanes = ir.Constant(vector(I32), list(range(8 * j, 8 * j + 8)))
                out.append(b.shuffle_vector(bits, bits, lanes))
        return out

    def mask_words(self, data: ir.Value, t0: list) -> list:
        """A bool tile (``data`` its array's pointer) as two ``i64``: row i's 8 bytes (each 0 or
        1) shifted left by i and or-ed together hold, in byte j, the 8 rows' bits at token j
        (the second word, token 8 + j)."""
        b = self.b
        words = []
        for part in range(0, TOKENS, 8):
            word = None
            for i, (off, t) in enumerate(zip(self.offsets, self._at(t0, part), strict=True)):
                p = b.bitcast(b.gep(data, [b.add(off, t)]), I64.as_pointer())
                x = b.shl(b.load(p, align=1), ir.Constant(I64, i))
                word = x if word is None else b.or_(word, x)
            words.append(word)
        return words

    def gather(self, arr: tuple, t: ir.Value) -> ir.Value:
        """Every row's token ``t``, as computed."""
        b, data = self.b, self.data(arr)
        out = ir.Constant(vector(data.type.pointee), ir.Undefined)
        for i, off in enumerate(self.offsets):
            x = b.load(b.gep(data, [b.add(off, t)]))
            out = b.insert_element(out, x, ir.Constant(I32, i))
        return self._arith(arr[0], out)

    def scatter(self, arr: tuple, t: ir.Value, x: ir.Value) -> None:
        """Store the vector ``x`` as every row's token ``t``."""
        b, data = self.b, self.data(arr)
        if arr[0].dtype == types.uint16:
            x = round_bf16(b, x)
        for i, off in enumerate(self.offsets):
            b.store(b.extract_element(x, ir.Constant(I32, i)), b.gep(data, [b.add(off, t)]))


Step = Callable[[dict, dict], tuple[dict, dict]]


_SKEW_FROM = 64  # tiles a row from which its group walks the rows skewed


def _broadcast(b: ir.IRBuilder, x: ir.Value, w: int = WIDTH) -> ir.Value:
    # the scalar x in w lanes
    undef = ir.Constant(vector(x.type, w), ir.Undefined)
    lane0 = b.insert_element(undef, x, ir.Constant(I32, 0))
    return b.shuffle_vector(lane0, undef, ir.Constant(vector(I32, w), [0] * w))


class Rows:
    """A scan's whole tiles made otherwise (:func:`reverse_scan`'s ``rows``): ``load(t0,
    carries) -> ({name: [token vectors]}, {carry: value})``, the inputs of the step (made a row
    at a time, or on token pairs) and the carries to hold after the tile (else the step's);
    ``step(x, state) -> (y, state)`` the very operations of the scan's own step on those
    inputs (None: the scan's step and ``fast``, given them); ``store(t0, ys)`` the outputs from
    ``ys = {name: [token vectors]}`` (None: by the group, token tiles); ``when(t0) -> i1`` where
    it is made so only on some tiles (the others by token tiles)."""

    def __init__(self, load, step: Step | None = None, store=None, when=None):
        self.load, self.step, self.store = load, step, store
        #: ``when(t0) -> i1``: the whole tiles (walked by every lane) made so, the others by
        #: token tiles (None: every tile)
        self.when = when
        #: ``by_rows(t0) -> (i1, <W x i1>)``, where ``when`` is false: whether the tile is made
        #: so too, with the rows whose tokens are all on (the lanes' mask); the others keep
        #: their carries and their outputs are zeros (None: by token tiles)
        self.by_rows = None
        #: while such a tile is emitted, the lanes whose outputs ``store`` stores (else None)
        self.on: ir.Value | None = None
        #: the rows making the tiles where ``when`` is false (and :attr:`by_rows` does not
        #: take them), the ramps' too (None: token tiles)
        self.otherwise: Rows | None = None
        #: ``(holds, quick)`` for :attr:`step` as :func:`reverse_scan`'s ``fast`` is for its
        #: step (None: :attr:`step` on every tile made so)
        self.fast: tuple | None = None

    def emit(self, b: ir.IRBuilder, t0: list, live: ir.Value | None, one) -> None:
        """Emit a tile by ``one(lanes, rows)``: made so (``rows`` this) where :attr:`when`
        holds (every tile where it is None), else on the rows :attr:`by_rows` gives (``lanes``
        those), else by :attr:`otherwise` (None: token tiles); with ``when``, the ramps' tiles
        (``live`` given) by :attr:`otherwise` too."""
        if self.when is None:
            one(live, self)
            return
        if live is not None:
            one(live, self.otherwise)
            return
        with b.if_else(self.when(t0)) as (whole, other):
            with whole:
                one(None, self)
            with other:
                if self.by_rows is None:
                    one(None, self.otherwise)
                    return
                uniform, on = self.by_rows(t0)
                with b.if_else(uniform) as (some_rows, tokens):
                    with some_rows:  # the other rows keep their carries, store zeros
                        self.on = on
                        one(on, self)
                        self.on = None
                    with tokens:
                        one(None, None)


def reverse_scan(
    group: Group,
    inputs: dict,
    outputs: dict,
    state: dict,
    step: Step,
    skip,
    take,
    fast=None,
    rows: Rows | None = None,
    idle=None,
) -> dict:
    """Emit the backward pass over time of one group: ``step(x, state) -> (y, state)`` with
    ``x`` the named input vectors at one token, ``y`` the named output vectors there and
    ``state`` the carries (vectors) from the token after it. ``inputs`` and ``outputs`` map
    names to ``(numba type, value)`` arrays; returns the state after the last token walked.

    ``skip`` and ``take`` (``i64``) give a piece of the rows in whole tiles counted from their
    end: the carries first walk the last ``skip`` tiles writing nothing (the very steps, so the
    very carries, of a whole pass), then ``take`` tiles are written, and the tokens before the
    first whole tile where those reach it. ``0, T // 16`` is the whole row; pieces that cover
    it give the whole row's bits, whatever thread runs which.

    ``fast``: ``(holds, quick)``, a step that gives ``step``'s very values on the tiles where
    ``holds(state, t0) -> i1`` (the carries at the tile's last token, the rows' first tokens),
    run on those tiles instead.

    ``rows``: the whole tiles' inputs, step and outputs made otherwise (:class:`Rows`); the
    tokens before the first whole tile still run ``step`` on ``inputs``, with the carries
    the tiles left.

    ``idle(t0) -> i1``: tiles (walked by every lane) where the step keeps every carry and
    gives 0 (+0.0) for every output (a mask-0 tile): zeros are stored, nothing computed."""
    b = group.b
    t_len = group.t_len
    w = ir.Constant(I64, TOKENS)
    tiles_n = b.sdiv(t_len, w)
    head = b.srem(t_len, w)  # the tokens before the last whole tile
    skip = b.select(b.icmp_signed("<", skip, tiles_n), skip, tiles_n)
    take = b.select(b.icmp_signed("<", take, b.sub(tiles_n, skip)), take, b.sub(tiles_n, skip))
    slots = {k: cgutils.alloca_once_value(b, v) for k, v in state.items()}

    def run(x):
        y, new = step(x, {k: b.load(p) for k, p in slots.items()})
        for k, p in slots.items():
            b.store(new[k], p)
        return y

    def tile(t0: list, live: ir.Value | None, written: dict) -> None:
        # one tile, row i from token t0[i]; with `live` (a lane mask) the other lanes keep
        # their carries and their rows' stores go to scratch memory
        if idle is not None and live is None:
            with b.if_else(idle(t0)) as (zeros, busy):
                with zeros:
                    for arr in written.values():
                        group.store_zeros(arr, t0)
                with busy:
                    work(t0, live, written)
            return
        work(t0, live, written)

    def work(t0: list, live: ir.Value | None, written: dict) -> None:
        if rows is None:
            one(t0, live, written, None)
            return
        rows.emit(b, t0, live, lambda lanes, made: one(t0, lanes, written, made))

    def one(t0: list, live: ir.Value | None, written: dict, rows: Rows | None) -> None:
        before = {k: b.load(p) for k, p in slots.items()}
        after: dict = {}
        if rows is None:
            tiles = {k: group.load(arr, t0) for k, arr in inputs.items()}
        else:
            tiles, after = rows.load(t0, before)

        def walk(stepper: Step) -> None:
            ys: dict = {k: [None] * TOKENS for k in written}
            carry = dict(before)
            for j in range(TOKENS - 1, -1, -1):
                y, carry = stepper({k: tile[j] for k, tile in tiles.items()}, carry)
                for k in written:
                    ys[k][j] = y.get(k)  # (a Rows step may give fewer: its store makes the rest)
            carry.update(after)
            for k, p in slots.items():
                b.store(carry[k] if live is None else b.select(live, carry[k], before[k]), p)
            if rows is not None and rows.store is not None:
                if written:
                    rows.store(t0, ys)
                return
            for k, arr in written.items():
                group.store(arr, t0, ys[k])

        stepper, quicker = step, fast
        if rows is not None and rows.step is not None:
            stepper, quicker = rows.step, rows.fast
        if quicker is None:
            walk(stepper)
            return
        holds, quick = quicker
        with b.if_else(holds(before, t0)) as (then, otherwise):
            with then:
                walk(quick)
            with otherwise:
                walk(stepper)

    def start(index: ir.Value) -> ir.Value:
        # the first token of the tile `index` tiles from the row's end
        return b.sub(t_len, b.mul(b.add(index, ir.Constant(I64, 1)), w))

    with cgutils.for_range(b, skip) as loop:  # the carries alone: nothing is stored
        tile([start(loop.index)] * WIDTH, None, {})

    # Row i walks its tiles `skew * i` steps after row 0 (skew 1 on long rows), so that the
    # rows' lines fall in different cache sets: where T is a power of two the rows are a
    # multiple of 4 KiB apart, and 32 lines in one set of a 12-way cache made float32 GAE a
    # quarter slower. In the first and last WIDTH - 1 steps a row may have no tile: its lane
    # computes on its first tile again, keeps its carries and stores to scratch memory.
    skew = b.zext(b.icmp_signed(">=", take, ir.Constant(I64, _SKEW_FROM)), I64)
    ramp = b.mul(skew, ir.Constant(I64, WIDTH - 1))
    lag = [b.mul(skew, ir.Constant(I64, i)) for i in range(WIDTH)]
    lane_lag = b.mul(_broadcast(b, skew), ir.Constant(vector(I64), list(range(WIDTH))))
    with cgutils.for_range(b, b.add(take, ramp)) as loop:
        k = loop.index
        edge = b.or_(b.icmp_signed("<", k, ramp), b.icmp_signed(">=", k, take))
        with b.if_else(edge) as (masked, plain):
            with masked:
                idx = [b.sub(k, d) for d in lag]
                on = [b.icmp_unsigned("<", i, take) for i in idx]  # below 0: large
                first = [b.select(a, i, ir.Constant(I64, 0)) for a, i in zip(on, idx, strict=True)]
                t0 = [start(b.add(skip, i)) for i in first]
                live = b.icmp_unsigned("<", b.sub(_broadcast(b, k), lane_lag), _broadcast(b, take))
                group.active = on
                tile(t0, live, outputs)
                group.active = None
            with plain:
                tile([start(b.add(skip, b.sub(k, d))) for d in lag], None, outputs)
    whole = b.icmp_signed("==", b.add(skip, take), tiles_n)
    with b.if_then(whole), cgutils.for_range(b, head) as loop:
        t = b.sub(b.sub(head, ir.Constant(I64, 1)), loop.index)
        y = run({k: group.gather(arr, t) for k, arr in inputs.items()})
        for k, arr in outputs.items():
            group.scatter(arr, t, y[k])
    return {k: b.load(p) for k, p in slots.items()}


def _fma(b: ir.IRBuilder, a: ir.Value, x: ir.Value, c: ir.Value) -> ir.Value:
    """``a * x + c`` rounded once, lane by lane (float64)."""
    t = a.type
    fn = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(t, [t, t, t]), f"llvm.fma.v{t.count}f64"
    )
    return b.call(fn, [a, x, c])


class _Kernel:
    """The arguments of a group kernel: ``(numba type, value)`` per array (None where the
    call passed None), the arithmetic dtype's conversions to and from the float64 carry."""

    def __init__(self, context, b, signature, args):
        self.b = b
        self.arrays = [
            None if isinstance(ty, types.NoneType) else (ty, value)
            for ty, value in zip(signature.args[:-3], args[:-3], strict=True)
        ]
        first = self.arrays[0]
        shape = context.make_array(first[0])(context, b, first[1]).shape
        n, t_len = cgutils.unpack_tuple(b, shape, 2)
        self.group = Group(context, b, n, t_len, args[-3])
        #: the piece of the rows (:func:`reverse_scan`)
        self.skip, self.take = args[-2], args[-1]
        self.wide = first[0].dtype == types.float64  # else float32 arithmetic
        self.zero = constant(F64 if self.wide else F32, 0.0)
        self.bits = first[0].dtype == types.uint16
        self.group.byte_masks = self.bits

    def ext(self, x: ir.Value) -> ir.Value:
        return x if self.wide else self.b.fpext(x, vector(F64))

    def narrow(self, x: ir.Value) -> ir.Value:
        return x if self.wide else self.b.fptrunc(x, vector(F32))


@intrinsic
def _gae_group(typingctx, r, v, mask, dones, cut, init, g, gl, adv, ret, k, skip, take):
    # One group of GAE (with ``v`` None, discounted returns): the step of
    # ``rlops.advantages.reference`` with the carry in float64 (see ``gae``).
    sig = types.void(r, v, mask, dones, cut, init, g, gl, adv, ret, k, skip, take)

    def codegen(context, b, signature, args):
        kern = _Kernel(context, b, signature, args)
        r_, v_, m_, d_, c_, init_, g_, gl_, adv_, ret_ = kern.arrays
        grp, zero = kern.group, kern.zero
        gamma_lam = grp.lanes(gl_)
        inputs = {"r": r_, "v": v_, "m": m_, "d": d_, "c": c_}
        inputs = {key: arr for key, arr in inputs.items() if arr is not None}
        if v_ is not None:
            gamma = grp.lanes(g_)
            state = {"acc": constant(F64, 0.0), "nxt": grp.lanes(init_)}
            outputs = {"adv": adv_, "ret": ret_}
        else:
            state = {"acc": kern.ext(grp.lanes(init_))}
            outputs = {"ret": ret_}

        def step(x, s):
            acc = s["acc"]
            if d_ is not None:  # an episode ends here: the carries are replaced, never scaled
                if v_ is not None:
                    s["nxt"] = b.select(x["d"], x["c"] if c_ is not None else zero, s["nxt"])
                    acc = b.select(x["d"], constant(F64, 0.0), acc)
                else:
                    end = kern.ext(x["c"]) if c_ is not None else constant(F64, 0.0)
                    acc = b.select(x["d"], end, acc)
            if v_ is not None:
                vt, nxt = x["v"], s["nxt"]
                delta = b.fsub(b.fadd(x["r"], b.fmul(gamma, nxt)), vt)
                new = _fma(b, gamma_lam, acc, kern.ext(delta))
                if m_ is None:
                    out = kern.narrow(new)
                    return {"adv": out, "ret": b.fadd(out, vt)}, {"acc": new, "nxt": vt}
                # a mask-0 token: 0 out, the carries pass through (the outputs narrowed from
                # the carry kept: one masked multiply-add, one zeroing conversion)
                m = x["m"]
                new = b.select(m, new, acc)
                adv = b.select(m, kern.narrow(new), zero)
                y = {"adv": adv, "ret": b.select(m, b.fadd(adv, vt), zero)}
                return y, {"acc": new, "nxt": b.select(m, vt, nxt)}
            new = _fma(b, gamma_lam, acc, kern.ext(x["r"]))
            if m_ is None:
                return {"ret": kern.narrow(new)}, {"acc": new}
            new = b.select(x["m"], new, acc)
            return {"ret": b.select(x["m"], kern.narrow(new), zero)}, {"acc": new}

        rows = None
        if v_ is not None and d_ is None and not kern.wide:
            made = _residual_pairs if kern.bits else _residual_rows
            rows = made(grp, kern, r_, v_, g_, gamma_lam, adv_, ret_)
            if m_ is not None:  # tiles where every token is an action token: as without mask

                def every(t0: list) -> ir.Value:
                    return _mask_tile(grp, m_, t0, every=True)

                rows.when = every
                if kern.bits:  # and where each row's tokens are all on or all off (float32:
                    # no faster than its token tiles)

                    def by_rows(t0: list) -> tuple[ir.Value, ir.Value]:
                        return _mask_rows(grp, m_, t0)

                    rows.by_rows = by_rows

        def none(t0: list) -> ir.Value:  # tiles of mask-0 tokens: zeros (dones reset carries)
            return _mask_tile(grp, m_, t0, every=False)

        idle = none if m_ is not None and d_ is None else None
        reverse_scan(grp, inputs, outputs, state, step, kern.skip, kern.take, rows=rows, idle=idle)
        return context.get_dummy_value()

    return sig, codegen


def _residual_rows(grp: Group, kern, r_, v_, g_, gamma_lam, adv_, ret_) -> Rows:
    # Plain GAE (values, no mask, no dones) a row at a time: the TD residual
    # r + gamma * v[t + 1] - v of a row's 16 tokens in one vector, its tiles transposed once,
    # and the returns adv + v a row at a time; the very operations of the step, in float32
    b = kern.b
    lanes = grp.lanes(g_)
    gamma = [
        _broadcast(b, b.extract_element(lanes, ir.Constant(I32, i)), TOKENS) for i in range(WIDTH)
    ]

    def load(t0, carries):
        r, v = grp.rows_of(r_, t0), grp.rows_of(v_, t0)
        # row i's next values: its tokens 1 to 15, then the value carried from the tile after
        twice = ir.Constant(vector(I32, TOKENS), list(range(WIDTH)) * 2)
        nxt = b.shuffle_vector(carries["nxt"], carries["nxt"], twice)
        after = []
        for i, vi in enumerate(v):
            lanes = ir.Constant(vector(I32, TOKENS), [*range(1, TOKENS), TOKENS + i])
            after.append(b.shuffle_vector(vi, nxt, lanes))
        delta = [
            b.fsub(b.fadd(ri, b.fmul(gi, ni)), vi)
            for ri, gi, ni, vi in zip(r, gamma, after, v, strict=True)
        ]
        first = ir.Constant(vector(F32), ir.Undefined)  # the value after the tile before
        for i, vi in enumerate(v):
            lane = ir.Constant(I32, i)
            first = b.insert_element(first, b.extract_element(vi, ir.Constant(I32, 0)), lane)
        return {"d": _rows_to_tokens(b, delta)}, {"nxt": first}

    def store(t0, ys):
        adv = _tokens_to_rows(b, ys["adv"])
        v = grp.rows_of(v_, t0)
        grp.store_rows(adv_, t0, adv)
        grp.store_rows(ret_, t0, [b.fadd(a, vi) for a, vi in zip(adv, v, strict=True)])

    return Rows(load, _residual_step(kern, gamma_lam), store)


def _residual_step(kern, gamma_lam) -> Step:
    # GAE's step on a tile's TD residuals "d" made beforehand: the carry's fused multiply-add
    def step(x, s):
        new = _fma(kern.b, gamma_lam, s["acc"], kern.ext(x["d"]))
        return {"adv": kern.narrow(new)}, {"acc": new, "nxt": s["nxt"]}

    return step


def _residual_pairs(grp: Group, kern, r_, v_, g_, gamma_lam, adv_, ret_) -> Rows:
    # Plain bfloat16 GAE on the tiles' token pairs (Group.load_pairs): the TD residual
    # r + gamma * v[t + 1] - v and the returns adv + v of two tokens in one vector of 16
    # lanes, the carry's step on each token; the very operations of the step, in float32
    b = kern.b
    gamma = grp.lanes(g_)
    gamma = _concat(b, gamma, gamma)
    held: dict = {}  # the tile's values, from its load to its store

    def load(t0, carries):
        (re, ro), (ve, vo) = grp.load_pairs(r_, t0), grp.load_pairs(v_, t0)
        # the next tokens' values: of evens[j] (tokens 2j, 2j + 8) odds[j]; of odds[j]
        # evens[j + 1], and for tokens 7 and 15, token 8 and the value carried from the tile
        # after
        nxt = _concat(b, carries["nxt"], carries["nxt"])
        last = ir.Constant(vector(I32, 2 * WIDTH), [*range(WIDTH, 3 * WIDTH)])
        after = [*ve[1:], b.shuffle_vector(ve[0], nxt, last)]

        def delta(r, n, v):
            return b.fsub(b.fadd(r, b.fmul(gamma, n)), v)

        de = [delta(*x) for x in zip(re, vo, ve, strict=True)]
        do = [delta(*x) for x in zip(ro, after, vo, strict=True)]
        held["v"] = ve, vo
        return {"d": _pairs_to_tokens(b, de, do)}, {"nxt": _sub(b, ve[0], 0, WIDTH)}

    def store(t0, ys):
        ae, ao = _tokens_to_pairs(b, ys["adv"])
        ve, vo = held["v"]
        re = [b.fadd(a, v) for a, v in zip(ae, ve, strict=True)]
        ro = [b.fadd(a, v) for a, v in zip(ao, vo, strict=True)]
        if rows.on is not None:  # the rows of mask-0 tokens: +0.0, as the step gives them
            on, zero = _concat(b, rows.on, rows.on), constant(F32, 0.0)
            zero = _concat(b, zero, zero)
            ae, ao, re, ro = ([b.select(on, x, zero) for x in xs] for xs in (ae, ao, re, ro))
        grp.store_pairs(adv_, t0, ae, ao)
        grp.store_pairs(ret_, t0, re, ro)

    rows = Rows(load, _residual_step(kern, gamma_lam), store)
    return rows


def _mask_tile(grp: Group, mask: tuple, t0: list, every: bool) -> ir.Value:
    # whether every row's mask of the tile is 1 (``every``), or is 0: from the words the token
    # tiles' lane masks are made of (Group.mask_words), computed once where both are emitted
    b = grp.b
    w0, w1 = grp.mask_words(grp.data(mask), t0)
    if every:
        return b.icmp_signed("==", b.and_(w0, w1), ir.Constant(I64, -1))
    return b.icmp_signed("==", b.or_(w0, w1), ir.Constant(I64, 0))


def _mask_rows(grp: Group, mask: tuple, t0: list) -> tuple[ir.Value, ir.Value]:
    # whether each row's mask is the same on all the tile's tokens (the 16 bytes of the mask
    # words equal), and the rows where it is 1 (<W x i1>: the first byte's bits)
    b = grp.b
    w0, w1 = grp.mask_words(grp.data(mask), t0)
    first = b.and_(w0, ir.Constant(I64, 0xFF))
    spread = b.mul(first, ir.Constant(I64, 0x0101010101010101))
    uniform = b.and_(b.icmp_signed("==", w0, w1), b.icmp_signed("==", w0, spread))
    return uniform, b.bitcast(b.trunc(first, I8), vector(I1))


def _acting_rows(grp: Group, mask: tuple, t0: list) -> ir.Value:
    # the rows with a 1 in their mask tile, as the bits of an i8 (an or of the mask words' bytes)
    b = grp.b
    w0, w1 = grp.mask_words(grp.data(mask), t0)
    x = b.or_(w0, w1)
    for k in (32, 16, 8):
        x = b.or_(x, b.lshr(x, ir.Constant(I64, k)))
    return b.trunc(x, I8)


@intrinsic
def _reinforce_group(typingctx, kl, outcome, ck, mask, gl, ret, k, skip, take):
    # One group of REINFORCE++ returns (see ``reinforce``).
    sig = types.void(kl, outcome, ck, mask, gl, ret, k, skip, take)

    def codegen(context, b, signature, args):
        kern = _Kernel(context, b, signature, args)
        kl_, outcome_, ck_, m_, gl_, ret_ = kern.arrays
        grp, zero = kern.group, kern.zero
        gamma_lam = grp.lanes(gl_)
        coef = b.load(grp.data(ck_))
        coef = b.shuffle_vector(
            b.insert_element(
                ir.Constant(vector(coef.type), ir.Undefined), coef, ir.Constant(I32, 0)
            ),
            ir.Constant(vector(coef.type), ir.Undefined),
            constant(I32, 0),
        )
        state = {"acc": constant(F64, 0.0), "pend": grp.lanes(outcome_)}

        def token_reward(kl: ir.Value) -> ir.Value:  # (8 lanes, or 16: two tokens)
            c = coef if kl.type.count == WIDTH else _concat(b, coef, coef)
            return b.fmul(c, kl)

        def pairs(t0: list, carries: dict) -> tuple[dict, dict]:
            # a bfloat16 tile's token rewards, two tokens a vector (Group.load_pairs)
            evens, odds = (
                [rounded_bf16(b, token_reward(x)) for x in xs] for xs in grp.load_pairs(kl_, t0)
            )
            return {"reward": _pairs_to_tokens(b, evens, odds), "m": grp.load(m_, t0)}, {}

        def stepper(second: bool) -> Step:
            def step(x, s):
                if kern.bits:  # rounded to bfloat16 as the token reward (on whole tiles, made
                    # beforehand on token pairs: rounded), and again with the outcome added
                    if "reward" in x:
                        reward = b.fadd(x["reward"], s["pend"])
                    else:
                        reward = b.fadd(rounded_bf16(b, token_reward(x["kl"])), s["pend"])
                    if second:
                        pending = b.fcmp_unordered("!=", s["pend"], zero)
                        reward = b.select(pending, rounded_bf16(b, reward), reward)
                else:
                    reward = b.fadd(token_reward(x["kl"]), s["pend"])
                m = x["m"]  # the outcome is added on the last action token, met first
                new = b.select(m, _fma(b, gamma_lam, s["acc"], kern.ext(reward)), s["acc"])
                return {"ret": b.select(m, kern.narrow(new), zero)}, {
                    "acc": new,
                    "pend": b.select(m, zero, s["pend"]),
                }

            return step

        def added(s, t0: list) -> ir.Value:
            # no row both with its outcome pending (not yet added, and not 0) and with an action
            # token in the tile: the second rounding counts in no lane (a row's tokens without
            # action keep its carries, whatever their reward)
            pending = b.bitcast(b.fcmp_unordered("!=", s["pend"], zero), I8)
            return b.icmp_unsigned(
                "==", b.and_(pending, _acting_rows(grp, m_, t0)), ir.Constant(I8, 0)
            )

        fast = (added, stepper(False)) if kern.bits else None
        inputs, outputs = {"kl": kl_, "m": m_}, {"ret": ret_}

        def none(t0: list) -> ir.Value:  # tiles of mask-0 tokens: zeros
            return _mask_tile(grp, m_, t0, every=False)

        def every(t0: list) -> ir.Value:  # tiles of action tokens alone
            return _mask_tile(grp, m_, t0, every=True)

        def acting(second: bool) -> Step:
            # stepper's step where every lane's token is an action token, each select taking
            # its mask-1 side: the pending outcome added on the tile's first token, then +0.0
            # (which turns a -0.0 reward into +0.0: kept, a carry may be -0.0 by underflow)
            def step(x, s):
                reward = x["reward"] if kern.bits else token_reward(x["kl"])
                reward = b.fadd(reward, s["pend"])
                if second and s["pend"] is not zero:  # (after the first token, the constant)
                    outcome = b.fcmp_unordered("!=", s["pend"], zero)
                    reward = b.select(outcome, rounded_bf16(b, reward), reward)
                new = _fma(b, gamma_lam, s["acc"], kern.ext(reward))
                return {"ret": kern.narrow(new)}, {"acc": new, "pend": zero}

            return step

        def tokens(t0: list, carries: dict) -> tuple[dict, dict]:
            return {"kl": grp.load(kl_, t0)}, {}

        step = stepper(True)
        # where every token acts, the rows' own step (its carries' chain without selects: the
        # walk for the carries alone 0.8x in bfloat16); the other tiles on token pairs (the
        # scan's step and fast) in bfloat16, token tiles in float32
        rows = Rows(pairs if kern.bits else tokens, step=acting(kern.bits), when=every)
        rows.fast = (added, acting(False)) if kern.bits else None
        rows.otherwise = Rows(pairs) if kern.bits else None
        reverse_scan(
            grp, inputs, outputs, state, step, kern.skip, kern.take, fast, rows=rows, idle=none
        )
        return context.get_dummy_value()

    return sig, codegen


_jit = njit(nogil=True)  # cached on disk, saves locked across processes


@_jit
def gae(r, v, mask, dones, cut, init, g, gl, adv, ret, start, stop, skip, take):
    """GAE advantages and returns of the row groups ``start`` to ``stop`` of ``r`` ``[N, T]``
    (with ``v`` None, discounted returns into ``ret``; ``adv`` is then None): ``mask``,
    ``dones`` (bool) and ``cut`` (the value after each end, in the arithmetic dtype) each
    ``[N, T]`` or None; ``init`` ``[N]`` the row's end value (the next-value carry with values,
    else the starting return), ``g`` ``[N]`` gamma in the arithmetic dtype (the TD residual's),
    ``gl`` ``[N]`` gamma * lam in float64 (the carry's decay). Per token, walking back::

        if done: nxt, acc = cut or 0, 0          (no values: acc = cut or 0)
        if mask: acc = fma(gl, acc, f64(r + g * nxt - v)); adv = narrow(acc); ret = adv + v;
                 nxt = v
        else:    adv = ret = 0                   (the carries pass through)

    ``skip`` and ``take``: the piece of the rows written, in tiles from their end
    (:func:`reverse_scan`; ``0, T // TOKENS`` the whole rows).
    """
    for k in range(start, stop):
        _gae_group(r, v, mask, dones, cut, init, g, gl, adv, ret, k, skip, take)


@_jit
def reinforce(kl, outcome, ck, mask, gl, ret, start, stop, skip, take):
    """REINFORCE++ returns of the row groups ``start`` to ``stop``: the token reward is
    ``ck[0] * kl[t]`` (``ck = -kl_coef`` in the arithmetic dtype; in bfloat16 rounded, and
    rounded again with the outcome added), plus ``outcome`` ``[N]`` on the row's last mask-1
    token, the first met walking back; mask-0 tokens give 0 and pass the carry through; ``gl``
    ``[N]`` the float64 discount, never 0 (such rows go to the chunked method). ``skip`` and
    ``take`` as in :func:`gae`."""
    for k in range(start, stop):
        _reinforce_group(kl, outcome, ck, mask, gl, ret, k, skip, take)
