"""Bad input gets a clear error; out-of-range values at inference saturate."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import qgru

I, H = 3, 4


def calib_batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 2, I, generator=g) for _ in range(n)]


def converted(config="w8a8", **kw) -> qgru.QuantGRU:
    torch.manual_seed(0)
    m = qgru.QuantGRU(I, H, config=config, **kw)
    qgru.calibrate(m, calib_batches(), progress=False)
    return m.convert()


@pytest.fixture(params=["float", "converted"])
def module(request):
    if request.param == "float":
        torch.manual_seed(0)
        return qgru.QuantGRU(I, H, num_layers=2, bidirectional=True)
    return converted(num_layers=2, bidirectional=True)


# =============================================================================================
# Input validation, float and converted modules
# =============================================================================================
class TestInputValidation:
    @pytest.mark.parametrize("shape", [(I,), (2, 5, 2, I)], ids=["1d", "4d"])
    def test_wrong_rank(self, module, shape):
        with pytest.raises(ValueError, match=rf"2-D \(unbatched\) or 3-D input, got {len(shape)}-D"):
            module(torch.randn(*shape))

    def test_input_size_mismatch(self, module):
        with pytest.raises(ValueError, match=rf"input size mismatch: expected last dimension {I}, got {I + 2}"):
            module(torch.randn(5, 2, I + 2))

    def test_input_size_mismatch_unbatched(self, module):
        with pytest.raises(ValueError, match="input size mismatch"):
            module(torch.randn(5, I - 1))

    def test_input_size_mismatch_packed(self, module):
        packed = pack_padded_sequence(torch.randn(4, 2, I + 1), torch.tensor([4, 3]))
        with pytest.raises(ValueError, match="input size mismatch"):
            module(packed)

    @pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
    def test_integer_dtype_input(self, module, dtype):
        x = torch.ones(5, 2, I, dtype=dtype)
        with pytest.raises(TypeError, match=r"floating-point tensor, got torch\."):
            module(x)

    def test_not_a_tensor(self, module):
        with pytest.raises(TypeError, match="expects a Tensor or PackedSequence, got list"):
            module([[0.0] * I])

    @pytest.mark.parametrize("h0_shape", [(4, 3, H), (2, 2, H), (4, 2, H + 1), (2, H)],
                             ids=["batch", "layers", "hidden", "rank"])
    def test_h0_wrong_shape(self, module, h0_shape):
        x = torch.randn(5, 2, I)
        with pytest.raises(ValueError, match=r"h0 must have shape \(4, 2, 4\), got"):
            module(x, torch.zeros(*h0_shape))

    def test_h0_wrong_shape_unbatched(self, module):
        with pytest.raises(ValueError, match=r"h0 must have shape \(4, 4\)"):
            module(torch.randn(5, I), torch.zeros(4, 1, H))

    def test_h0_wrong_batch_packed(self, module):
        packed = pack_padded_sequence(torch.randn(4, 2, I), torch.tensor([4, 3]))
        with pytest.raises(ValueError, match=r"h0 must have shape \(4, 2, 4\)"):
            module(packed, torch.zeros(4, 3, H))

    def test_h0_integer_dtype(self, module):
        with pytest.raises(TypeError, match="h0 must be a floating-point tensor"):
            module(torch.randn(5, 2, I), torch.zeros(4, 2, H, dtype=torch.int64))

    def test_batch_first_h0_uses_batch_dim(self):
        m = converted(batch_first=True)
        x = torch.randn(2, 5, I)  # N = 2, T = 5
        m(x, torch.zeros(1, 2, H))  # right
        with pytest.raises(ValueError, match=r"h0 must have shape \(1, 2, 4\), got \(1, 5, 4\)"):
            m(x, torch.zeros(1, 5, H))

    @pytest.mark.parametrize("batch", [{"x": 1}, "text", 3.5], ids=["dict", "str", "float"])
    def test_non_tensor_calibration_batch_is_named(self, batch):
        """Issue 30 item 9: a dict batch raised a TypeError without the "calibration batch 0:"
        prefix the README promises; it is a QGRUDtypeError (still a TypeError), which calibrate()
        names the batch of."""
        m = qgru.QuantGRU(I, H)
        with pytest.raises(TypeError, match=r"^calibration batch 1: QuantGRU expects a Tensor or PackedSequence, "
                                            rf"got {type(batch).__name__}") as e:
            qgru.calibrate(m, [torch.randn(5, 2, I), batch], progress=False)
        assert isinstance(e.value, qgru.QGRUDtypeError)

    def test_bad_input_during_calibration(self):
        m = qgru.QuantGRU(I, H)
        m.train()
        with pytest.raises(ValueError, match="input size mismatch"):
            qgru.calibrate(m, [torch.randn(5, 2, I + 1)], progress=False)
        assert m.training and "calibrating" not in repr(m)

    def test_good_input_still_works(self, module):
        """The checks reject only what is wrong (so the tests above are not trivially satisfied)."""
        out, h = module(torch.randn(5, 2, I), torch.zeros(4, 2, H))
        assert out.shape == (5, 2, 2 * H) and h.shape == (4, 2, H)
        out, h = module(torch.randn(5, I))
        assert out.shape == (5, 2 * H) and h.shape == (4, H)


# =============================================================================================
# Workflow order: calibrate -> convert -> export
# =============================================================================================
class TestWorkflowOrder:
    def test_convert_without_calibrate(self):
        m = qgru.QuantGRU(I, H)
        with pytest.raises(RuntimeError, match=r"calibrat"):
            m.convert()
        assert not m.is_converted
        with pytest.raises(RuntimeError, match=r"qgru\.calibrate\(model, batches\)"):
            m.convert()

    def test_convert_twice(self):
        m = converted()
        with pytest.raises(RuntimeError, match="already converted"):
            m.convert()
        assert m.is_converted

    def test_calibrate_converted_module(self):
        m = converted()
        with pytest.raises(RuntimeError, match="already converted"):
            qgru.calibrate(m, calib_batches(), progress=False)

    def test_convert_after_observers_saw_no_data(self):
        m = qgru.QuantGRU(I, H)
        m.start_calibration()
        m.stop_calibration()
        with pytest.raises(RuntimeError, match="saw no data"):
            m.convert()
        assert not m.is_converted

    @pytest.mark.parametrize("empty", [list, lambda: (b for b in [])], ids=["list", "generator"])
    def test_calibrate_empty_batches(self, empty):
        m = qgru.QuantGRU(I, H)
        with pytest.raises(ValueError, match="empty"):
            qgru.calibrate(m, empty(), progress=False)
        # and the module cannot be converted from that calibration
        with pytest.raises(RuntimeError, match="saw no data"):
            m.convert()

    def test_calibrate_model_without_quantgru(self):
        model = nn.Sequential(nn.Linear(I, H))
        with pytest.raises(ValueError, match=r"no qgru\.QuantGRU"):
            qgru.calibrate(model, calib_batches(), progress=False)
        gru = nn.GRU(I, H)  # a plain nn.GRU is not a QuantGRU either
        with pytest.raises(ValueError, match=r"no qgru\.QuantGRU"):
            qgru.calibrate(gru, calib_batches(), progress=False)

    def test_quantize_model_without_gru(self):
        model = nn.Sequential(nn.Linear(I, H), nn.ReLU())
        with pytest.raises(ValueError, match=r"no torch\.nn\.GRU"):
            qgru.quantize_model(model, calib_batches(), progress=False)

    def test_export_before_convert(self):
        m = qgru.QuantGRU(I, H)
        with pytest.raises(RuntimeError, match=r"export\(\) needs a converted model"):
            m.export()
        qgru.calibrate(m, calib_batches(), progress=False)
        with pytest.raises(RuntimeError, match="converted"):
            m.export()
        m.convert()
        assert isinstance(m.export(), qgru.QuantParams)

    def test_from_float_rejects_non_gru(self):
        with pytest.raises(TypeError, match="expects a torch.nn.GRU, got LSTM"):
            qgru.QuantGRU.from_float(nn.LSTM(I, H))


# =============================================================================================
# Config errors
# =============================================================================================
def load(overrides=None, config="w8a8"):
    return qgru.QuantConfig.load(config, overrides=overrides)


class TestConfigErrors:
    def test_builtin_configs_load(self):
        for name in ("w8a8", "w8a16", "w16a16"):
            assert load(config=name).name == name

    def test_unknown_tensor_key(self):
        with pytest.raises(ValueError, match=r"config\.tensors\.h: unknown key\(s\) 'bitz'"):
            load({"tensors": {"h": {"bitz": 8}}})

    def test_override_adding_a_tensor_without_bits(self):
        """An override of h_gemm on a config without one (w16a16) names the tensor and the missing
        bits (it said "bits must be an integer, got None"); with bits it adds the tensor."""
        with pytest.raises(ValueError, match=r"config\.tensors\.h_gemm: config 'w16a16' has no h_gemm.*must give its bits"):
            load({"tensors": {"h_gemm": {"dynamic": False}}}, config="w16a16")
        assert load({"tensors": {"h_gemm": {"bits": 8}}}, config="w16a16").tensors["h_gemm"].bits == 8
        assert load({"tensors": {"h_gemm": {"dynamic": False}}}).tensors["h_gemm"].bits == 8  # w8a8 has one

    def test_unknown_top_level_key(self):
        with pytest.raises(ValueError, match=r"config: unknown key\(s\) 'tensorz'"):
            load({"tensorz": {}})

    def test_unknown_observer_key(self):
        with pytest.raises(ValueError, match=r"config\.observer: unknown key\(s\) 'momentumm'"):
            load({"observer": {"momentumm": 0.2}})

    def test_unknown_tensor_name(self):
        with pytest.raises(ValueError, match=r"config\.tensors: unknown key\(s\) 'hidden'"):
            load({"tensors": {"hidden": {"bits": 8}}})

    @pytest.mark.parametrize("name", ["w4a4", "W8A8", "w8a8.toml"])
    def test_unknown_config_name(self, name):
        with pytest.raises(ValueError, match=rf"unknown config '{name}'.*w8a8"):
            load(config=name)

    def test_config_of_wrong_type(self):
        with pytest.raises(TypeError, match="config must be a name"):
            qgru.QuantConfig.load(8)

    @pytest.mark.parametrize("bits", [0, 1, 17, 32, 8.0, "8", None])
    def test_bits_out_of_range(self, bits):
        with pytest.raises(ValueError, match=r"config\.tensors\.h: bits must be an integer in \[2, 16\]"):
            load({"tensors": {"h": {"bits": bits}}})

    def test_bits_in_range_accepted(self):
        assert load({"tensors": {"h": {"bits": 16}}})["h"].bits == 16
        assert load({"tensors": {"x": {"bits": 2}}})["x"].bits == 2

    def test_table_input_needs_4_bits(self):
        with pytest.raises(ValueError, match=r"z_pre: a table input needs at least 4 bits"):
            load({"tensors": {"z_pre": {"bits": 3}}})

    @pytest.mark.parametrize("tensor,gran", [("x", "per_channel"), ("h", "per_gate"), ("z_pre", "per_channel"),
                                             ("W", "per_gate"), ("Wx", "per_group"), ("R", "rowwise")])
    def test_granularity_not_allowed(self, tensor, gran):
        with pytest.raises(ValueError, match=rf"granularity '{gran}' is not supported for {tensor}"):
            load({"tensors": {tensor: {"granularity": gran}}})

    def test_per_group_needs_group_size(self):
        with pytest.raises(ValueError, match="per_group needs a positive integer group_size"):
            load({"tensors": {"W": {"granularity": "per_group"}}})
        with pytest.raises(ValueError, match="group_size is only meaningful"):
            load({"tensors": {"W": {"group_size": 4}}})

    @pytest.mark.parametrize("gate", ["z", "r", "g"])
    def test_symmetric_for_gate_output(self, gate):
        with pytest.raises(ValueError, match=rf"tensors\.{gate}: the grid of a gate output is fixed.*only 'bits'"):
            load({"tensors": {gate: {"symmetric": True}}})

    @pytest.mark.parametrize("w", ["W", "R"])
    def test_weights_symmetric_false(self, w):
        with pytest.raises(ValueError, match=rf"tensors\.{w}: weights are symmetric.*symmetric must be true"):
            load({"tensors": {w: {"symmetric": False}}})

    def test_symmetric_not_bool(self):
        with pytest.raises(ValueError, match="symmetric must be true or false"):
            load({"tensors": {"x": {"symmetric": "yes"}}})

    @pytest.mark.parametrize("mode", ["pow3", "", "Pow2"])
    def test_scale_mode_invalid(self, mode):
        with pytest.raises(ValueError, match=rf"scale_mode must be one of .*got '{mode}'"):
            load({"scale_mode": mode})

    @pytest.mark.parametrize("kind", ["max", "EMA", "histogram"])
    def test_observer_kind_invalid(self, kind):
        with pytest.raises(ValueError, match=rf"observer: kind must be one of .*got '{kind}'"):
            load({"observer": {"kind": kind}})

    @pytest.mark.parametrize("momentum", [0.0, -0.1, 1.5])
    def test_observer_momentum_invalid(self, momentum):
        with pytest.raises(ValueError, match=r"momentum must be in \(0, 1\]"):
            load({"observer": {"momentum": momentum}})

    @pytest.mark.parametrize("percentile", [50.0, 0.0, 100.5, True, "99"])
    def test_observer_percentile_invalid(self, percentile):
        with pytest.raises(ValueError, match=r"config\.observer: percentile must be (in \(50, 100\]|a number)"):
            load({"observer": {"percentile": percentile}})

    @pytest.mark.parametrize("headroom", [0.5, 0, -2.0, True, "2"])
    def test_headroom_invalid(self, headroom):
        with pytest.raises(ValueError, match=r"tensors\.z_pre: headroom must be a number >= 1"):
            load({"tensors": {"z_pre": {"headroom": headroom}}})

    @pytest.mark.parametrize("tensor", ["W", "R", "z", "g"])
    def test_headroom_not_for_weights_or_gate_outputs(self, tensor):
        with pytest.raises(ValueError, match=rf"tensors\.{tensor}: headroom applies to calibrated activations only"):
            load({"tensors": {tensor: {"headroom": 2.0}}})

    def test_headroom_valid_accepted(self):
        assert load({"tensors": {"x": {"headroom": 1.5}}})["x"].headroom == 1.5

    @pytest.mark.parametrize("headroom", [float("nan"), float("inf")], ids=["nan", "inf"])
    def test_headroom_non_finite_rejected_at_load(self, headroom):
        with pytest.raises(ValueError, match=r"tensors\.z_pre: headroom"):
            load({"tensors": {"z_pre": {"headroom": headroom}}})

    def test_missing_tensor_in_dict_config(self):
        d = load().to_dict()
        del d["tensors"]["g_pre"]
        with pytest.raises(ValueError, match="missing g_pre"):
            qgru.QuantConfig.load(d)

    def test_tensor_entry_not_a_table(self):
        with pytest.raises(TypeError, match=r"config\.tensors\.x must be a table/dict"):
            load({"tensors": {"x": 8}})

    def test_bad_config_rejected_by_quantgru(self):
        with pytest.raises(ValueError, match="'bitz'"):
            qgru.QuantGRU(I, H, config={**load().to_dict(), "tensors": {**load().to_dict()["tensors"],
                                                                         "h": {"bitz": 8}}})


# =============================================================================================
# Out-of-range values at inference saturate
# =============================================================================================
def _x_grid(m):
    """The ends of layer 0's x grid: its widest x level's with x levels (the shipped default), where
    inputs saturate; else the static grid's."""
    p = m.export().to_dict()
    scale = float(p["l0.fwd.x_levels.scale"][-1]) if "l0.fwd.x_levels.scale" in p else float(p["l0.fwd.scale.x"])
    zp, bits = int(p["l0.fwd.zp.x"]), m.qconfig["x"].bits
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return (qmin - zp) * scale, (qmax - zp) * scale, float(p["l0.fwd.scale.h"])


class TestSaturation:
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_huge_inputs_saturate(self, seed):
        m = converted()
        x = 1e6 * torch.randn(7, 3, I, generator=torch.Generator().manual_seed(seed))
        out, h_n = m(x)
        lo, hi, s_h = _x_grid(m)
        assert torch.isfinite(out).all() and torch.isfinite(h_n).all()
        # GRU outputs are convex combinations of tanh values and h (h0 = 0): |out| <= 1 up to a grid step
        assert out.abs().max() <= 1 + 2 * s_h
        assert h_n.abs().max() <= 1 + 2 * s_h
        # saturation: the same as the input clamped to the ends of the x grid
        out_c, h_c = m(x.clamp(lo, hi))
        assert torch.equal(out, out_c) and torch.equal(h_n, h_c)

    def test_huge_h0_saturates(self):
        m = converted()
        x = torch.randn(4, 2, I)
        out, h_n = m(x, torch.full((1, 2, H), 1e6))
        assert torch.isfinite(out).all() and torch.isfinite(h_n).all()
        # h0 is clamped onto the h grid, whose range covers about [-1, 1] after calibration
        assert out.abs().max() <= 2.0

    def test_huge_inputs_w8a16_multiplier(self):
        m = converted(config=qgru.QuantConfig.load("w8a16", overrides={"scale_mode": "multiplier"}))
        out, _ = m(1e6 * torch.randn(5, 2, I))
        assert torch.isfinite(out).all()
        assert out.abs().max() <= 1.01

    def test_very_large_finite_inputs_saturate_like_large_ones(self):
        m = converted()
        x = torch.ones(5, 2, I)
        x[..., 1] = -1.0
        out_big, h_big = m(1e6 * x)
        out_huge, h_huge = m(1e30 * x)  # finite in float32
        assert torch.equal(out_big, out_huge) and torch.equal(h_big, h_huge)
