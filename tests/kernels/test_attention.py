"""store_kv, paged decode and paged prefill attention against their references (Triton interpreter
on CPU, the real compiler on CUDA). Shapes are small and tiles big so the interpreter stays fast."""

from __future__ import annotations

import pytest
import torch

from tokenrelay.kernels import ops as kernels
from tokenrelay.kernels import _validate
from tokenrelay.kernels._testing import make_case, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (Hq, Hkv): GQA ratios 1, 4, 8 and the non-powers-of-two 3 and 6 (few KV heads: few programs).
GQA = [(2, 2), (8, 2), (8, 1), (3, 1), (6, 1)]
DTYPES = [torch.float32, torch.float16]
DECODE_LENS = [1, 15, 16, 17, 70, 129]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(_validate, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "kernel left unwritten (NaN) elements"
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(ref.dtype))


# ---------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_matches_ref(dtype):
    num_blocks, page, heads, dim, tokens = 9, 16, 3, 32, 37
    k_cache = torch.randn(num_blocks, page, heads, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    # a view of a fused projection: rows are strided, heads x dims packed
    fused = torch.randn(tokens, 3 * heads * dim, device=DEVICE).to(dtype)
    key = fused[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    value = fused[:, 2 * heads * dim :].view(tokens, heads, dim)
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:tokens]
    slots[[0, 5, tokens - 1]] = -1
    refs = k_cache.clone(), v_cache.clone()
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    kernels.store_kv_ref(key, value, refs[0], refs[1], slots)
    assert torch.equal(k_cache, refs[0]) and torch.equal(v_cache, refs[1])


def test_store_kv_int32_slots_and_empty():
    k_cache = torch.randn(4, 8, 2, 16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    key, value = torch.randn(5, 2, 16, device=DEVICE), torch.randn(5, 2, 16, device=DEVICE)
    slots = torch.tensor([31, 0, -1, 8, 7], dtype=torch.int32, device=DEVICE)
    refs = k_cache.clone(), v_cache.clone()
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    kernels.store_kv_ref(key, value, refs[0], refs[1], slots)
    assert torch.equal(k_cache, refs[0]) and torch.equal(v_cache, refs[1])
    kernels.store_kv(key[:0], value[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, refs[0])


# ---------------------------------------------------------------- decode

def _run_decode(case, num_splits, split_tokens=None):
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    split = {} if split_tokens is None else {"split_tokens": split_tokens}
    out = kernels.paged_decode_attention(*args, num_splits=num_splits, **split)
    _assert_close(out, kernels.paged_decode_attention_ref(*args))
    return out


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_ref(dtype, heads):
    # Each GQA ratio runs both paths across the two dtypes: the table's capacity (144 tokens) in
    # one split (direct store, the default split size) and in three splits of 64 tokens shared
    # by two programs (partials + LSE merge).
    split = (GQA.index(heads) % 2 == 0) == (dtype == torch.float16)
    case = make_case(DECODE_LENS, None, heads[0], heads[1], 32, dtype=dtype, device=DEVICE)
    _run_decode(case, 2 if split else None, 64 if split else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_more_programs_than_splits(dtype):
    case = make_case([1, 16, 17, 90], None, 8, 1, 32, dtype=dtype, device=DEVICE)
    _run_decode(case, 7, 64)  # at most 2 splits of 64 per sequence: programs capped at 2


@pytest.fixture(params=[True, False], ids=["native-dots", "upcast-dots"])
def dots(request, monkeypatch):
    """Both kinds of dots over 16-bit K/V (kernels/paged_tile.py: NATIVE_DOTS)."""
    from tokenrelay.kernels import paged_tile
    monkeypatch.setattr(paged_tile, "NATIVE_DOTS", request.param)


@pytest.mark.parametrize("page,head_dim", [(8, 32), (32, 64), (16, 80), (12, 32), (128, 32),
                                           (64, 160)])
def test_decode_page_sizes_and_head_dims(page, head_dim, dots):
    # pages below, equal to and above the 64-token tile (32 for head_dim 160), and one that is
    # not a power of two; fp16, so native dots run under the interpreter too
    case = make_case([3, 31, 33, 140], None, 8, 2, head_dim, block_size=page,
                     dtype=torch.float16, device=DEVICE)
    _run_decode(case, 2, 64)


def test_decode_splits_several_tiles_each():
    """Splits of 128 tokens hold two 64-token tiles; one program loops over three splits."""
    case = make_case([300, 7, 129], None, 4, 1, 32, device=DEVICE)
    _run_decode(case, 1, 128)


@pytest.mark.parametrize("split_tokens", [64, 256])
def test_decode_with_128_token_tiles(monkeypatch, split_tokens):
    """The tile the GPU check's decode sweep tries: 128 tokens, halved to 64 where a split is
    only 64 tokens long (a split must end on a tile)."""
    from tokenrelay.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "BLOCK_N", 128)
    case = make_case([300, 7, 129, 600], None, 8, 2, 32, dtype=torch.float16, device=DEVICE)
    _run_decode(case, 2, split_tokens)


def test_decode_result_depends_on_nothing_but_the_sequence():
    """Fixed-size splits merged in order: a sequence's output is bit-equal whatever the number of
    programs, the width of the table, or the other sequences in the batch."""
    case = make_case([300, 7, 129, 64], None, 8, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    base = kernels.paged_decode_attention(*args, num_splits=1, split_tokens=64)
    for programs in (2, 5, None):
        assert torch.equal(kernels.paged_decode_attention(*args, num_splits=programs,
                                                          split_tokens=64), base)
    pad = torch.zeros(4, 7, dtype=torch.int32, device=DEVICE)
    wide = torch.cat([case.block_tables, pad], dim=1).contiguous()
    assert torch.equal(kernels.paged_decode_attention(*args[:3], wide, *args[4:], split_tokens=64),
                       base)
    alone = kernels.paged_decode_attention(case.query[1:2], case.k_cache, case.v_cache,
                                           case.block_tables[1:2, :1].contiguous(),
                                           case.seq_lens[1:2], case.scale, split_tokens=64)
    assert torch.equal(alone, base[1:2])              # one split: the direct store, same bits
    _assert_close(base, kernels.paged_decode_attention_ref(*args))


def test_decode_default_splits_on_a_wide_table():
    """As under CUDA graphs: the table has max_model_len / page columns, most of them padding, so
    num_splits=None shares the capacity's splits and most find no tokens."""
    from tokenrelay.kernels.decode_attention import choose_num_splits

    case = make_case([300, 7], None, 4, 1, 32, device=DEVICE)
    pad = torch.zeros(2, 64 - case.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    case.block_tables = torch.cat([case.block_tables, pad], dim=1).contiguous()
    assert choose_num_splits(2, 1, 64 * 16 // 256, 132) == 4
    _run_decode(case, None)


def test_decode_zero_length_sequence_gives_zeros():
    case = make_case([0, 17], None, 4, 2, 32, device=DEVICE)
    for splits, split_tokens in ((1, 256), (2, 64)):
        out = kernels.paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                             case.seq_lens, case.scale, num_splits=splits,
                                             split_tokens=split_tokens)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_choose_num_splits_fills_what_the_sms_hold(monkeypatch):
    from tokenrelay.kernels import decode_attention
    from tokenrelay.kernels.decode_attention import choose_num_splits

    monkeypatch.setattr(decode_attention, "PROGRAMS_PER_SM", 4)   # the figures below assume it
    assert choose_num_splits(64, 8, 16, 132) == 2             # 512 (sequence, head) pairs, 528 slots
    assert choose_num_splits(32, 8, 16, 132) == 3
    assert choose_num_splits(1, 8, 16, 132) == 16             # every split its own program
    assert choose_num_splits(1, 8, 1, 132) == 1               # one split: nothing to share
    monkeypatch.setattr(decode_attention, "PROGRAMS_PER_SM", 2)
    assert choose_num_splits(64, 8, 16, 132) == 1             # 512 pairs fill 264 slots already
    assert choose_num_splits(32, 8, 16, 132) == 2
    # batch 8 at 4k in splits of 512: 5 programs would share 8 splits as 2, 2, 2, 2 and one
    # idle; 4 take the same shares with no idle program
    assert choose_num_splits(8, 8, 8, 132) == 4
    assert choose_num_splits(1, 1, 10, 3) == 5                  # not 6 (2, 2, 2, 2, 2 and none)


# ---------------------------------------------------------------- prefill

# (context_len, q_len): prefix 0, query length 1, page-boundary lengths and ragged mixes.
SPANS = [(0, 1), (0, 15), (0, 16), (0, 17), (5, 1), (20, 13), (16, 16), (40, 30)]


def _run_prefill(case):
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
            case.cu_seqlens_q, case.scale)
    _assert_close(kernels.paged_prefill_attention(*args), kernels.paged_prefill_attention_ref(*args))


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_ref(dtype, heads):
    seq_lens = [c + q for c, q in SPANS]
    case = make_case(seq_lens, [q for _, q in SPANS], heads[0], heads[1], 32, dtype=dtype, device=DEVICE)
    _run_prefill(case)


@pytest.mark.parametrize("page,head_dim,dtype", [(8, 32, torch.bfloat16), (32, 64, torch.float32),
                                                 (16, 80, torch.float16)])
def test_prefill_page_sizes_and_head_dims(page, head_dim, dtype, dots):
    case = make_case([17, 50, 1], [17, 9, 1], 8, 2, head_dim, block_size=page, dtype=dtype, device=DEVICE)
    _run_prefill(case)


@pytest.mark.parametrize("rows,keys", [(64, 64), (128, 128)])
def test_prefill_with_other_tiles(monkeypatch, rows, keys):
    """Tiles the GPU check's prefill sweep tries: 64 or 128 query rows (16 or 32 tokens x 4
    heads) by 64 or 128 keys."""
    from tokenrelay.kernels import prefill_attention

    monkeypatch.setattr(prefill_attention, "TILE_ROWS", rows)
    monkeypatch.setattr(prefill_attention, "BLOCK_N", keys)
    seq_lens = [c + q for c, q in SPANS]
    _run_prefill(make_case(seq_lens, [q for _, q in SPANS], 8, 2, 32, dtype=torch.float16,
                           device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_prefill_long_context_takes_unmasked_tiles(dtype):
    """Contexts past a key tile: whole tiles below the diagonal run without the causal mask,
    the diagonal's with it (a query tile of 100 tokens spans several key tiles)."""
    spans = [(150, 100), (64, 1), (63, 70)]
    case = make_case([c + q for c, q in spans], [q for _, q in spans], 4, 1, 32, dtype=dtype,
                     device=DEVICE)
    _run_prefill(case)


def test_prefill_with_empty_span():
    case = make_case([10, 4, 20], [3, 0, 20], 4, 2, 32, device=DEVICE)
    _run_prefill(case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_then_prefill_then_decode_matches_dense(dtype):
    """The engine's sequence of calls: store the new tokens' K/V, attend (prefill), store one more
    token, decode — checked against dense causal attention on contiguous K/V."""
    heads, kv_heads, dim, page = 6, 2, 32, 16
    ctx, new = [0, 19, 33], [21, 1, 12]
    seq_lens = [c + n for c, n in zip(ctx, new)]
    case = make_case([s + 1 for s in seq_lens], new, heads, kv_heads, dim, page, dtype, DEVICE)
    full_k = [torch.randn(s + 1, kv_heads, dim, device=DEVICE).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s + 1, kv_heads, dim, device=DEVICE).to(dtype) for s in seq_lens]

    def slots(b, positions):
        table = case.block_tables[b].long()
        return table[positions // page] * page + positions % page

    # prefix already cached
    for b, c in enumerate(ctx):
        pos = torch.arange(c, device=DEVICE)
        kernels.store_kv(full_k[b][:c], full_v[b][:c], case.k_cache, case.v_cache, slots(b, pos))
    # this step's new tokens, one flat batch
    new_slots = torch.cat([slots(b, torch.arange(c, c + n, device=DEVICE)) for b, (c, n) in enumerate(zip(ctx, new))])
    new_k = torch.cat([full_k[b][c : c + n] for b, (c, n) in enumerate(zip(ctx, new))])
    new_v = torch.cat([full_v[b][c : c + n] for b, (c, n) in enumerate(zip(ctx, new))])
    kernels.store_kv(new_k, new_v, case.k_cache, case.v_cache, new_slots)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = kernels.paged_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                          seq_t, case.cu_seqlens_q, case.scale)
    cu = case.cu_seqlens_q.tolist()
    for b, (c, n) in enumerate(zip(ctx, new)):
        dense = _dense_causal(case.query[cu[b] : cu[b + 1]], full_k[b][: c + n], full_v[b][: c + n], case.scale, c)
        _assert_close(out[cu[b] : cu[b + 1]], dense.to(dtype))

    # decode one more token per sequence
    last = torch.tensor(seq_lens, device=DEVICE)
    dec_slots = torch.stack([slots(b, last[b : b + 1])[0] for b in range(len(seq_lens))])
    kernels.store_kv(torch.stack([k[-1] for k in full_k]), torch.stack([v[-1] for v in full_v]),
                     case.k_cache, case.v_cache, dec_slots)
    q = torch.randn(len(seq_lens), heads, dim, device=DEVICE).to(dtype)
    out = kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                         seq_t + 1, case.scale, num_splits=2)
    for b, s in enumerate(seq_lens):
        dense = _dense_causal(q[b : b + 1], full_k[b], full_v[b], case.scale, s)
        _assert_close(out[b : b + 1], dense.to(dtype))


def _dense_causal(q, k, v, scale, context_len):
    """Plain softmax attention with an explicit per-query-head loop: nothing shared with the refs."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    rows = torch.arange(q.shape[0], device=q.device)[:, None] + context_len
    cols = torch.arange(k.shape[0], device=q.device)[None, :]
    for h in range(q.shape[1]):
        scores = q[:, h].double() @ k[:, h // group].double().T * scale
        scores[cols > rows] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group].double()
    return out
