"""Hypothesis strategies for CP cases (docs/shrink.md): `@given(case=cpgold.strategies.cases(cp_size=4, comm="p2p"))`.

Every case drawn is valid (docs/case-spec.md): lengths with zero-length and length-1 sequences, padding between
sequences beyond the CP rounding, tail rows (where the comm type takes them), GQA and MQA, head dims (MLA's
dim_v != dim_qk too), every comm type and its a2a group size, masks and windows, every pad fill, bf16/fp16/fp32.
Keyword arguments fix a key or bound its range; Hypothesis shrinks a failing case toward fewer and shorter sequences,
fewer heads, smaller dims, no mask, no padding and zero pad fill on its own.

Needs Hypothesis (`pip install hypothesis`, Debian python3-hypothesis); the rest of the package does not.
"""
try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised where Hypothesis is absent
    raise ImportError("cpgold.strategies needs Hypothesis, which is not installed: pip install hypothesis "
                      "(Debian: apt-get install python3-hypothesis)") from e

from .errors import InputError

COMMS = ("p2p", "a2a", "all_gather", "a2a+p2p")
MASKS = ("none", "causal")
PAD_FILLS = ("zero", "random", "nan", "inf")
DTYPES = ("bf16", "fp16", "fp32")


def _choices(name, value, allowed):
    values = (value,) if isinstance(value, (str, int)) else tuple(value)
    if not values:
        raise InputError(f"{name}: expected at least one of {allowed}, got none", name)
    for v in values:
        if v not in allowed:
            raise InputError(f"{name}: {v!r} is not one of {allowed}", name)
    return values


def _bound(name, value, low):
    if not isinstance(value, int) or value < low:
        raise InputError(f"{name}: expected an integer >= {low}, got {value!r}", name)
    return value


def _min_cp_size(comms):
    """The least W drawn for any of the comm types: a2a+p2p is drawn with a2a groups of a2a_size >= 2 dividing W (the
    case parser takes a2a_size 1 or W = 1 too, but a2a groups of one rank split no heads: that is p2p), so it needs
    W >= 2; the others take W = 1."""
    return min(2 if c == "a2a+p2p" else 1 for c in comms)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _cases(draw, cp_size, comm, max_cp_size, min_sequences, max_sequences, max_seqlen, zero_length, max_heads_q, gqa,
           dims, mla, masks, windows, pad_fills, dtypes, extra_padding, tail_rows, cross, max_seed, empty_batch):
    # Only a W some comm type of `comm` takes: a2a+p2p alone needs W >= 2 (cases() checked that one exists).
    w = cp_size if cp_size is not None else draw(st.integers(_min_cp_size(comm), max_cp_size))
    c = draw(st.sampled_from([c for c in comm if w >= _min_cp_size((c,))]))
    case = {"cp_size": w, "comm": c}
    unit = 1  # heads_q and heads_kv are multiples of it
    if c == "a2a":
        unit = w
    elif c == "a2a+p2p":
        a = draw(st.sampled_from([d for d in _divisors(w) if d > 1]))
        case["a2a_size"] = a
        unit = a
    # Heads: heads_kv a multiple of the unit, a GQA group of 1, 2, 4 or 8 (MQA when heads_kv is the unit 1).
    most = max(unit, max_heads_q)
    heads_kv = unit * draw(st.integers(1, max(1, most // unit)))
    groups = [g for g in (1, 2, 4, 8) if heads_kv * g <= most] if gqa else [1]
    group = draw(st.sampled_from(groups))
    case["heads_q"] = heads_kv * group
    if group > 1:
        case["heads_kv"] = heads_kv
    case["dim_qk"] = draw(st.sampled_from(dims))
    if mla and len(dims) > 1 and draw(st.booleans()):
        case["dim_v"] = draw(st.sampled_from(dims))
    case["dtype"] = draw(st.sampled_from(dtypes))
    mask = draw(st.sampled_from(masks))
    if mask == "causal":
        case["mask"] = "causal"
    windowed = windows and draw(st.booleans())
    if windowed:
        left = draw(st.integers(-1, max_seqlen))
        right = 0 if mask == "causal" else draw(st.integers(-1, max_seqlen))
        case["window"] = [left, right]
    # Lengths: Hypothesis draws small integers first and shrinks toward 0, so 0 and 1 come often.
    n = draw(st.integers(min_sequences, max_sequences))
    length = st.integers(0 if zero_length else 1, max_seqlen)
    lq = [draw(length) for _ in range(n)]
    if not empty_batch and not any(lq):
        lq[draw(st.integers(0, n - 1))] = draw(st.integers(1, max_seqlen))  # something to compare
    case["seqlens_q"] = lq
    lkv = lq
    if cross and (w == 1 or (mask == "none" and not windowed)) and draw(st.booleans()):
        lkv = [draw(length) for _ in range(n)]
        case["seqlens_kv"] = lkv
    m = 2 * w
    for side, lengths in (("q", lq), ("kv", lkv)):
        extra = [m * draw(st.integers(0, 2)) for _ in lengths] if extra_padding else [0] * n
        if any(extra):
            case[f"padded_{side}"] = [(x + m - 1) // m * m + e for x, e in zip(lengths, extra)]
        if tail_rows and (w == 1 or c == "p2p"):
            tail = draw(st.integers(0, 2)) * w if w > 1 else draw(st.integers(0, 3))
            if tail:
                padded = case.get(f"padded_{side}")
                if padded is None and side == "kv" and case.get("seqlens_kv", lq) == lq:
                    # self-attention (no seqlens_kv, or the same lengths): K/V are laid out as Q when padded_kv is absent
                    padded = case.get("padded_q")
                if padded is None:
                    padded = [(x + m - 1) // m * m for x in lengths]
                case[f"total_tokens_{side}"] = sum(padded) + tail
    case["pad_fill"] = draw(st.sampled_from(pad_fills))
    case["seed"] = draw(st.integers(0, max_seed))
    return case


def cases(*, cp_size=None, comm=COMMS, max_cp_size=4, min_sequences=1, max_sequences=4, max_seqlen=64,
          zero_length=True, max_heads_q=8, gqa=True, dims=(8, 16, 32, 64), mla=True, masks=MASKS, windows=True,
          pad_fills=PAD_FILLS, dtypes=("bf16", "fp16"), extra_padding=True, tail_rows=True, cross=True,
          max_seed=2**31 - 1, empty_batch=False):
    """A strategy of valid case dicts (`cpgold.generate(case)` takes them).

    cp_size: a fixed W (None: drawn from 1..max_cp_size). comm: a comm type or several to draw from.
    min_sequences / max_sequences, max_seqlen: the batch and the lengths (zero_length=False keeps every length >= 1).
    max_heads_q (a2a needs heads divisible by W: then at least W), gqa (heads_kv < heads_q: GQA, and MQA with one KV
    head), dims (head dims drawn from; mla: dim_v drawn apart), masks ("none", "causal"), windows (a sliding window,
    left and right up to max_seqlen), pad_fills, dtypes, extra_padding (up to two more chunks of 2W rows of padding
    after a sequence), tail_rows (rows past the last sequence, where the comm type takes them), cross (seqlens_kv !=
    seqlens_q where the mask allows it under CP), max_seed, empty_batch (allow a batch whose every sequence is empty:
    its check compares no element and passes, the report saying `no_valid_element`).
    Every W drawn is one the comm type drawn takes (a2a+p2p: W >= 2, with an a2a_size >= 2 dividing it); a cp_size or
    max_cp_size that no comm type of `comm` takes is an InputError here, not while drawing."""
    comms = _choices("comm", comm, COMMS)
    if cp_size is not None:
        _bound("cp_size", cp_size, 1)
        if cp_size < _min_cp_size(comms):
            raise InputError(f"comm: a2a+p2p is drawn with a2a groups of >= 2 ranks, so it needs cp_size >= 2, got "
                             f"cp_size {cp_size}", "comm")
    _bound("max_cp_size", max_cp_size, 1)
    if cp_size is None and max_cp_size < _min_cp_size(comms):
        raise InputError(f"max_cp_size: comm a2a+p2p is drawn with a2a groups of >= 2 ranks, so it needs cp_size >= 2, "
                         f"got max_cp_size {max_cp_size}", "max_cp_size")
    _bound("min_sequences", min_sequences, 1)
    _bound("max_sequences", max_sequences, min_sequences)
    _bound("max_seqlen", max_seqlen, 0 if zero_length and empty_batch else 1)
    _bound("max_heads_q", max_heads_q, 1)
    _bound("max_seed", max_seed, 0)
    dims = tuple(dims)
    for d in dims:
        _bound("dims", d, 1)
    if not dims:
        raise InputError("dims: expected at least one head dim", "dims")
    return _cases(cp_size, comms, max_cp_size, min_sequences, max_sequences, max_seqlen,
                  zero_length, max_heads_q, gqa, dims, mla, _choices("masks", masks, MASKS), windows,
                  _choices("pad_fills", pad_fills, PAD_FILLS), _choices("dtypes", dtypes, DTYPES), extra_padding,
                  tail_rows, cross, max_seed, empty_batch)
