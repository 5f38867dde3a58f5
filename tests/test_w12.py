"""W12, the lossless 12-bit weight format: exact round trips (escapes of every kind), the record
layout on a hand-built tile, the converter and the automatic loader (bit-exact, greedy output equal
to the bf16 checkpoint's), and refusal of damaged records."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.cli import main
from tandem.config import ConfigError, GenerationConfig, SpecConfig
from tandem.models.loader import load_model
from tandem.quant.checkpoint import read_w12_checkpoint, write_w12_checkpoint
from tandem.quant.w12 import (RECORD_BYTES, VIEW_BYTES, W12Escapes, W12Records, check_w12, decode_w12,
                              decode_w12_view8, dense_escapes, encode_w12, verify_w12, w12_stats)
from tandem.quant.w12_gemm import (DENSE_SLOTS_PER_TILE, FIX_CHUNK, GEMV_PROGRAMS_PER_SM, _decode_half_torch, pack_w12,
                                   split_for, w12_gemv_emulated, w12_linear_emulated, w12_linear_ref)
from tandem.runtime.generate import Generator
from tandem.runtime.pair import BUNDLED_DRAFT, BUNDLED_TARGET, load_pair

BITS = torch.int16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS)


def _bf16(*values: int) -> torch.Tensor:
    """bf16 scalars from raw bit patterns."""
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values], dtype=BITS).view(torch.bfloat16)


def _realistic(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights shaped like a trained checkpoint's: Student-t (3 dof) tails, per-channel scales
    spread over a decade, a few large outlier columns."""
    g = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(3, n, k, generator=g).pow(2).sum(0) / 3
    t = torch.randn(n, k, generator=g) / chi2.sqrt()  # [N, K] Student-t, 3 degrees of freedom
    scale = 10 ** (torch.rand(n, 1, generator=g) - 2.5)  # [N, 1]: 3e-3 .. 3e-2
    w = t * scale
    w[:, torch.randint(0, k, (max(k // 256, 1),), generator=g)] *= 8
    return w.to(torch.bfloat16)


def _with_specials(w: torch.Tensor) -> torch.Tensor:
    w = w.clone()
    n, k = w.shape
    specials = _bf16(0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x0080, 0x7F7F)  # +-0, denormals,
    # +-inf, two NaNs with payloads, the smallest and the largest normal
    for i, v in enumerate(specials):
        w[(3 * i) % n, (7 * i) % k] = v
    w[min(1, n - 1), :] = 0  # a channel of zeros: no window at all
    w[min(2, n - 1), : k // 2] = _bf16(0x0003)  # denormals only in half a channel
    w[0, -1] = w[0, 0].abs().clamp_min(1) * 2.0**30  # an extreme outlier: most of channel 0 escapes below it
    return w


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (128, 64), (130, 70), (300, 200), (256, 640)])
def test_round_trip_is_bit_exact_with_every_kind_of_escape(shape):
    w = _with_specials(_realistic(*shape, seed=sum(shape)))
    records, escapes = encode_w12(w)
    tn, tk = -(-shape[0] // 128), -(-shape[1] // 64)
    assert records.data.shape == (tn, tk, RECORD_BYTES) and records.data.dtype == torch.uint8
    restored = decode_w12(records, escapes)
    assert restored.dtype == torch.bfloat16 and torch.equal(_bits(restored), _bits(w))
    verify_w12(w, records, escapes)  # no error
    # every non-finite, zero and denormal weight is an escape, stored with its raw bits
    exp = (_bits(w).int() >> 7) & 0xFF
    must = (exp == 0) | (exp == 255)
    flags = torch.zeros(shape, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(shape[0]), (escapes.offsets[1:] - escapes.offsets[:-1]).long())
    flags[rows, escapes.index.long()] = True
    assert bool(flags[must].all())
    assert torch.equal(escapes.bits, _bits(w)[rows, escapes.index.long()])


def test_escape_rate_and_bits_per_weight_on_realistic_weights():
    w = _realistic(1024, 2048, seed=1)
    records, escapes = encode_w12(w)
    s = w12_stats(records, escapes)
    assert torch.equal(_bits(decode_w12(records, escapes)), _bits(w))
    assert s.escape_rate < 1e-3, s.escape_rate  # the paper's real checkpoints: 7.3e-5
    assert 12.0 < s.bits_per_weight < 12.1, s.bits_per_weight


def test_tile_layout_on_a_hand_built_tile():
    # channel n: column 0 holds the channel's largest value 2^(n % 8) (offset 15, mantissa 0); column k > 0 holds
    # sign (k odd), offset (n + k) % 15 + 1 and mantissa (7n + k) % 128: 15 binades below, never the reserved code.
    w = torch.empty(128, 64, dtype=torch.bfloat16)
    want = {}
    for n in range(128):
        top = n % 8
        w[n, 0] = 2.0**top
        want[n, 0] = (0, 15, 0)
        for k in range(1, 64):
            s, off, m = k % 2, (n + k) % 15 + 1, (7 * n + k) % 128
            w[n, k] = (-1) ** s * 2.0 ** (top - 15 + off) * (1 + m / 128)
            want[n, k] = (s, off, m)
    records, escapes = encode_w12(w)
    assert escapes.index.numel() == 0 and records.data.shape == (1, 1, 12288)
    assert torch.equal(records.base, torch.tensor([127 + n % 8 - 15 for n in range(128)], dtype=torch.int16))
    rec = records.data[0, 0].tolist()
    for (n, k), (s, off, m) in want.items():
        assert rec[n * 64 + k] == (s << 7) | (off << 3) | (m >> 4), (n, k)  # first 8 KB: the 8-bit view
        nibble = rec[VIEW_BYTES + n * 32 + k % 32] >> (4 if k >= 32 else 0) & 0xF  # last 4 KB: low bits
        assert nibble == m & 0xF, (n, k)
    assert rec[0] == 0x78 and rec[1] == 0x80 | (2 << 3) | 0  # w[0,0] = 1.0; w[0,1] = -2^-13 * (1 + 1/128)
    assert torch.equal(_bits(decode_w12(records, escapes)), _bits(w))
    # the 8-bit view alone: low bits at their midpoint, within half a step of 16/128 of the value
    coarse = decode_w12_view8(records, escapes).float()
    assert bool(((coarse - w.float()).abs() <= w.float().abs() * 8 / 128).all())


def test_window_bottom_and_escape_slots_read_zero():
    # the window bottom +-2^(B - 127) exactly is the reserved code's value: it escapes, its slot reads 0
    w = torch.tensor([[1.0, 2.0**-15, -(2.0**-15), 2.0**-16, 2.0**-15 * 1.0078125]], dtype=torch.bfloat16)
    records, escapes = encode_w12(w)
    assert escapes.index.tolist() == [1, 2, 3] and escapes.offsets.tolist() == [0, 3]
    assert records.data[0, 0, 1:4].tolist() == [0, 0, 0] and records.data[0, 0, 4] == 0  # mantissa 1: low bits
    assert records.data[0, 0, VIEW_BYTES + 4] == 1
    cols, vals = dense_escapes(escapes, 1)
    assert cols.tolist() == [[1, 2, 3]] and torch.equal(_bits(vals), _bits(w[:, 1:4]))
    assert torch.equal(_bits(decode_w12(records, escapes)), _bits(w))


def test_inconsistent_parts_are_refused():
    w = _realistic(130, 70, seed=3)
    r, e = encode_w12(w)
    with pytest.raises(ConfigError, match="records have shape"):
        check_w12(W12Records(r.data[:1], r.base, r.shape), e)
    bad_col = e.index.clone()
    bad_col[0] = 70
    with pytest.raises(ConfigError, match="outside"):
        decode_w12(r, W12Escapes(e.offsets, bad_col, e.bits))
    corrupt = r.data.clone()
    corrupt[0, 0, 5] ^= 0x01  # one mantissa bit of one weight
    with pytest.raises(ConfigError, match=r"1 weight\(s\) differ"):
        verify_w12(w, W12Records(corrupt, r.base, r.shape), e, "w")
    with pytest.raises(ConfigError, match="2-D bfloat16"):
        encode_w12(w.float())


def test_kernel_emulation_equals_reference():
    """The Triton kernel's algorithm (split-K tile walk, halves, select-free decode, corrections,
    split sums) emulated in torch against decode-then-matmul, at a ragged shape with escapes."""
    w = _realistic(200, 190, seed=4)
    w[1, :] = 0
    w[2, :50] = _bf16(0x0003)  # denormals
    w[0, -1] = 100.0  # an outlier: most of channel 0 falls below its window and escapes
    w[3, 7] = w[3].abs().max() * 2.0**-15  # the window bottom itself
    r, e = encode_w12(w)
    assert e.index.numel() > 200
    x = torch.randn(5, 190, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = w12_linear_ref(x, r, e)
    got = w12_linear_emulated(x, r, e)
    assert ref.shape == got.shape == (5, 200)
    exact = x.double() @ w.double().T  # [5, 200]
    scale = x.double().abs() @ w.double().abs().T  # error scale of each output
    assert bool(((got.double() - exact).abs() <= 1e-2 * scale + 1e-30).all())
    assert bool(((ref.double() - exact).abs() <= 1e-2 * scale + 1e-30).all())
    assert torch.equal(got, w12_linear_emulated(x, r, e))  # fixed reduction order: same bits every run



def _hard_matrix() -> torch.Tensor:
    w = _with_specials(_realistic(260, 330, seed=9))
    w[5, :] = 0  # a channel of zeros: B_n = 0, no corrections at all
    for n, c, sign in ((6, 3, 1), (7, 10, -1)):  # the window bottom itself: an escape whose slot decodes to z_n
        top = int(((_bits(w[n]).int() >> 7) & 0xFF).max())
        w[n, c] = sign * 2.0 ** (top - 15 - 127)
    return w


def _kernel_decode(records: W12Records, base7: torch.Tensor) -> torch.Tensor:
    """The whole matrix as the kernel decodes it tile by tile (reserved slots read z_n, not 0)."""
    tn, tk, _ = records.data.shape
    rows = []
    for pn in range(tn):
        b7 = base7[pn * 128:(pn + 1) * 128]
        tiles = []
        for rec in records.data[pn].int():
            view, low = rec[:VIEW_BYTES].view(128, 64), rec[VIEW_BYTES:].view(128, 32)
            tiles += [_decode_half_torch(view[:, :32], low & 0xF, b7), _decode_half_torch(view[:, 32:], low >> 4, b7)]
        rows.append(torch.cat(tiles, dim=1))
    n, k = records.shape
    return torch.cat(rows)[:n, :k]  # [N, K] bf16


def _plan_fixes(plan, tn: int, tk: int) -> dict[tuple[int, int], list[float]]:
    """Every correction term of a plan by (channel, column), from its sparse lists and dense cells,
    checking that each lies in its own program's channels and tiles."""
    fixes: dict[tuple[int, int], list[float]] = {}
    off, d_off = plan.fix_off.tolist(), plan.dense_off.tolist()
    n_prog = tn * (128 // plan.block_n) * plan.splits
    assert len(off) == len(d_off) == n_prog + 1 and all((b - a) % FIX_CHUNK == 0 for a, b in zip(off, off[1:]))
    assert (plan.splits - 1) * plan.per < tk <= plan.splits * plan.per
    paired = plan.fix_negz.numel() > 0
    for prog in range(n_prog):
        blk, s = divmod(prog, plan.splits)
        for i in range(off[prog], off[prog + 1]):
            n, c = blk * plan.block_n + int(plan.fix_ch[i]), int(plan.fix_col[i])
            terms = [float(plan.fix_val[i])] + ([float(plan.fix_negz[i])] if paired else [])
            if not any(terms):
                continue  # padding (adds exactly 0)
            assert s * plan.per <= c // 64 < (s + 1) * plan.per, (prog, c)  # in its program's own tiles
            fixes.setdefault((n, c), []).extend(terms)
        for d in range(d_off[prog], d_off[prog + 1]):
            n = blk * plan.block_n + int(plan.dense_ch[d])
            val, negz = plan.dense_val[d].float()  # [per * 64] each: the split's columns
            slots = ((val != 0) | (negz != 0)).nonzero()[:, 0].tolist()
            assert len(slots) > DENSE_SLOTS_PER_TILE * plan.per  # only escape-heavy cells are dense
            for pos in slots:
                fixes.setdefault((n, s * plan.per * 64 + pos), []).extend([float(val[pos]), float(negz[pos])])
    return fixes


def test_corrections_restore_every_escaped_slot_exactly():
    """The kernels decode every slot without a select (a reserved slot reads z_n = 2^(B_n - 127)) and
    add their program's corrections (sparse entries and dense cells): per slot, decoded value +
    corrections == the weight, exactly, for both kernels' plans at several SM counts."""
    import math

    w = _hard_matrix()
    r, e = encode_w12(w)
    assert int(r.base.min()) >= 0
    tn, tk, _ = r.data.shape
    for sms, block_n in ((1, 128), (3, 64), (132, 32)):
        p = pack_w12(r, e, "cpu", sms=sms, gemv_block_n=block_n)
        assert (p.splits, p.per) == split_for(tn, tk, sms) and p.gemv.block_n == block_n
        assert (p.gemv.splits, p.gemv.per) == split_for(tn * 128 // block_n, tk, sms, GEMV_PROGRAMS_PER_SM)
        dense = _kernel_decode(r, p.base7).double()  # [N, K] as the kernels decode
        for plan in (p.dot, p.gemv):
            fixes = _plan_fixes(plan, tn, tk)
            got = dense.clone()
            for (n, c), vals in fixes.items():
                got[n, c] = math.fsum([float(dense[n, c])] + vals)  # exact: every term is a bf16 value
            want = w.double()
            same = (got == want) | (got.isnan() & want.isnan())
            assert bool(same.all()), same.logical_not().nonzero()[:5]
            assert not any((5, c) in fixes for c in range(330))  # the zero channel needs nothing
            assert sorted(v for v in fixes[6, 3] if v) == sorted([float(w[6, 3]), -float(w[6, 3])])  # value, -z_n
            assert int(plan.dense_off[-1]) > 0  # channel 0 (an outlier above the rest) is dense


def test_kernel_emulation_rows_do_not_depend_on_the_batch():
    """A row's bits are the same alone, in a block of 16, or among 70 rows (the kernel's property)."""
    w = _hard_matrix()
    w[:, :] = torch.where(w.float().abs() < 1e30, w, torch.zeros_like(w))  # finite outputs to compare
    r, e = encode_w12(w)
    x = torch.randn(70, 330, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    full = w12_linear_emulated(x, r, e)
    assert bool(torch.isfinite(full.float()).all())
    for rows in (slice(0, 1), slice(5, 6), slice(16, 33), slice(69, 70)):
        assert torch.equal(w12_linear_emulated(x[rows], r, e), full[rows]), rows


@pytest.mark.parametrize("block_n,sms", [(128, 1), (64, 4), (32, 132)])
def test_gemv_emulation_equals_reference_and_rows_do_not_depend_on_the_batch(block_n, sms):
    """The GEMV kernel's arithmetic (tests/w12_checks.py holds the kernel to it bitwise): within bf16
    rounding of decode-then-matmul, with sparse and dense corrections, one or several K splits; and a
    row's bits the same alone or among up to 8 rows."""
    w = _hard_matrix()
    w[:, :] = torch.where(w.float().abs() < 1e30, w, torch.zeros_like(w))  # finite outputs to compare
    r, e = encode_w12(w)
    x = torch.randn(8, 330, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = w12_gemv_emulated(x, r, e, sms=sms, block_n=block_n)
    exact = x.double() @ w.double().T  # [8, 260]
    scale = x.double().abs() @ w.double().abs().T
    assert full.shape == (8, 260) and bool(((full.double() - exact).abs() <= 5e-3 * scale + 1e-30).all())
    p = pack_w12(r, e, "cpu", sms=sms, gemv_block_n=block_n)
    assert int(p.gemv.dense_off[-1]) > 0  # channel 0's escapes below its outlier are dense cells
    for rows in (slice(0, 1), slice(3, 4), slice(0, 5), slice(7, 8)):
        assert torch.equal(w12_gemv_emulated(x[rows], r, e, sms=sms, block_n=block_n), full[rows]), rows


def test_pack_accepts_negative_window_bases_of_older_files():
    # a channel of tiny weights: top exponent 7. Files written before bases were clamped at 0 stored
    # B = -8 and offsets exp + 8; decoding is the same, and packing re-encodes to B = 0.
    w = (torch.rand(3, 64, generator=torch.Generator().manual_seed(2)) + 0.5).to(torch.bfloat16)
    w[1] = (2.0**-120 * (1 + torch.arange(64) / 64)).to(torch.bfloat16)
    r, e = encode_w12(w)
    assert int(r.base[1]) == 0
    data = r.data.clone()
    view = data[0, 0, :VIEW_BYTES].view(128, 64)
    inside = (view[1].int() | data[0, 0, VIEW_BYTES:].view(128, 32)[1].repeat(2).int()) != 0
    view[1] = torch.where(inside, view[1] + (8 << 3), view[1])  # offset + 8
    base = r.base.clone()
    base[1] = -8
    old = W12Records(data, base, r.shape)
    assert torch.equal(_bits(decode_w12(old, e)), _bits(w))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(w12_linear_emulated(x, old, e), w12_linear_emulated(x, r, e))

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("w12") / "target"
    return write_w12_checkpoint(BUNDLED_TARGET, out)


def test_bundled_target_converts_and_decodes_bit_exactly(converted):
    assert converted.matrices > 0 and converted.size_ratio < 0.8, converted.size_ratio
    assert converted.escape_rate < 1e-3
    got = read_w12_checkpoint(converted.out)
    with safe_open(str(BUNDLED_TARGET / "model.safetensors"), framework="pt") as f:
        assert sorted(got) == sorted(f.keys())
        for key in f.keys():
            assert torch.equal(_bits(got[key]), _bits(f.get_tensor(key))), key
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (converted.out / name).read_bytes() == (BUNDLED_TARGET / name).read_bytes()
    a, b = load_model(converted.out, dtype="bfloat16"), load_model(BUNDLED_TARGET, dtype="bfloat16")
    for (ka, ta), (kb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(ta, tb), ka


def test_greedy_output_of_w12_checkpoint_equals_bf16(converted):
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    outs = {}
    for name, target in (("bf16", BUNDLED_TARGET), ("w12", converted.out)):
        pair = load_pair(target, BUNDLED_DRAFT)
        engine = Generator(pair.target, pair.draft, pair.tokenizer)
        ids = pair.tokenizer.encode("class Stack:\n    def __init__(self):").ids
        outs[name] = [engine.generate(ids, m, spec=SpecConfig(nodes=16), gen=gen).token_ids for m in ("ar", "tree")]
    assert outs["w12"] == outs["bf16"] and len(outs["w12"][0]) == 24


def _damage(folder, key_part: str, flip: int = 0x10) -> None:
    f = folder / "model.safetensors"
    with safe_open(str(f), framework="pt") as sf:
        tensors, meta = {k: sf.get_tensor(k) for k in sf.keys()}, sf.metadata()
    key = next(k for k in sorted(tensors) if k.endswith(key_part))
    flat = tensors[key].view(-1)
    flat[flat.numel() // 2] ^= flip
    save_file(tensors, str(f), metadata=meta)


@pytest.mark.parametrize("part", [".w12_records", ".w12_esc_bits"])
def test_damaged_w12_checkpoint_is_refused_at_load(converted, tmp_path, capsys, part):
    bad = tmp_path / "bad"
    shutil.copytree(converted.out, bad)
    _damage(bad, part)
    with pytest.raises(ConfigError, match="bit for bit|reserved zero code"):
        load_model(bad)
    code = main(["generate", "hi", "--target", str(bad), "--method", "ar", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tandem: error:") and err.count("\n") == 1 and "W12 matrix" in err


def test_convert_cli(tmp_path, capsys, tiny_checkpoint):
    out = tmp_path / "w12"
    assert main(["convert", "--w12", "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "size ratio 0.7" in line and "bit for bit" in line
    assert (out / "config.json").is_file()
    tiny = tiny_checkpoint("llama")  # float32
    capsys.readouterr()  # drop transformers' save progress bar
    for args, needle in ((["convert", "--out", str(tmp_path / "x")], "--w12"),
                         (["convert", "--w12", "--out", str(out)], "not an empty folder"),
                         (["convert", "--w12", "--target", str(tiny), "--out", str(tmp_path / "y")],
                          "bfloat16"),
                         (["convert", "--w12", "--target", str(out), "--out", str(tmp_path / "z")], "already a W12")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("tandem: error:") and needle in err and err.count("\n") == 1, err
