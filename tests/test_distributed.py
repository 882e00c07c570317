"""Calibration across torch.distributed ranks (qgru/distributed.py): two gloo ranks on localhost,
spawned once for the module (a group timeout of 20 s and a 120 s deadline turn a hang into a
failure). Uneven and empty shards convert to one process's integers on all the data; ranks that
disagree (structure, config, observer, scale mode, weights) all raise the same error naming it;
sync_calibration then convert on one rank alone; the collectives are coalesced; an explicit group.
Also: the reduction's device for a group's backend, QAT's frozen grids in the state_dict (exact
resume), and sharded (DTensor) weights at convert_qat."""
from __future__ import annotations

import copy
import datetime
import os
import warnings

import pytest
import torch
from torch import nn

import qgru
from conftest import spawn_ranks

I, H = 3, 4
N_BATCHES = 4


def _data():
    g = torch.Generator().manual_seed(77)
    return [torch.randn(4, 2, I, generator=g) * (1 + b) for b in range(N_BATCHES)]


def _shard(data, rank):
    """Rank 0's 3 batches, rank 1's 1: uneven, and in an order whose float sums (the gptq moments)
    are one process's exactly: (s0 + s1 + s2) + s3."""
    return data[:3] if rank == 0 else data[3:]


def _model(config="w8a8", hidden=H, seed=1234, observer=None, scale_mode=None, num_layers=1) -> qgru.QuantGRU:
    over = {}
    if observer:
        over["observer"] = {"kind": observer}
    if scale_mode:
        over["scale_mode"] = scale_mode
    torch.manual_seed(seed)
    return qgru.QuantGRU(I, hidden, num_layers=num_layers, bidirectional=True,
                         config=qgru.QuantConfig.load(config, overrides=over or None))


class _Two(nn.Module):
    """Two GRUs in a row: quantize_model reduces both in one go."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = nn.GRU(I, H), nn.GRU(H, H)

    def forward(self, x):
        return self.b(self.a(x)[0])[0]


def _err(fn):
    try:
        fn()
    except Exception as e:  # recorded for the test to check
        return f"{type(e).__name__}: {e}"
    return "no error"


class _Counting:
    """Counts the torch.distributed collectives called while active (or makes them fail)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "all_gather_into_tensor",
             "reduce_scatter_tensor", "barrier")

    def __init__(self, forbid: bool = False):
        self.forbid, self.calls, self.saved = forbid, {}, {}

    def __enter__(self):
        import torch.distributed as dist
        for n in self.NAMES:
            orig = getattr(dist, n)
            self.saved[n] = orig

            def wrap(*a, _n=n, _orig=orig, **k):
                self.calls[_n] = self.calls.get(_n, 0) + 1
                if self.forbid:
                    raise AssertionError(f"collective {_n} called")
                return _orig(*a, **k)
            setattr(dist, n, wrap)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for n, f in self.saved.items():
            setattr(dist, n, f)


def _worker(rank: int, world: int, init_method: str, outdir: str) -> None:
    """Top-level so that torch.multiprocessing.spawn can pickle it; every rank runs the same scenarios
    in the same order (each one's collectives complete before the next starts)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    data = _data()
    res = {}
    try:
        # uneven shards (3 batches and 1), default config (mse, gptq moments): one process's integers
        m = _model()
        qgru.calibrate(m, _shard(data, rank), progress=False)
        with _Counting() as c:
            m.convert()
        res["uneven"], res["uneven_calls"] = m.export().to_dict(), c.calls
        # an empty shard joins with no data
        m = _model(observer="minmax")
        qgru.calibrate(m, data[:2] if rank == 0 else [], progress=False)
        m.convert()
        res["empty_shard"] = m.export().to_dict()
        m = _model(observer="ema")
        qgru.calibrate(m, data[:2] if rank == 1 else [], progress=False)
        m.convert()
        res["empty_shard_ema"] = m.export().to_dict()
        # every shard empty: the same error on every rank
        m = _model()
        qgru.calibrate(m, [], progress=False)
        res["all_empty"] = _err(m.convert)
        # ranks that disagree: the same error on every rank, before anything is reduced
        other = {"hidden": dict(hidden=5), "observer": dict(observer="ema"), "config": dict(config="w8a16"),
                 "scale_mode": dict(scale_mode="pow2"), "weights": dict(seed=99), "layers": dict(num_layers=2)}
        base = {"observer": dict(observer="minmax")}
        for name, kw in other.items():
            m = _model(**(kw if rank == 1 else base.get(name, {})))
            qgru.calibrate(m, data[rank::2], progress=False)
            res[f"mismatch_{name}"] = _err(m.convert)
        # quantize_model on every rank: one reduction for the whole model
        net = _Two()
        with _Counting() as c:
            q = qgru.quantize_model(net, [(x,) for x in _shard(data, rank)], "w8a8", progress=False)
        res["quantize_model"] = [g.export().to_dict() for g in (q.a, q.b)]
        res["quantize_model_calls"] = c.calls
        # sync on every rank, then convert on rank 0 alone: no collective in convert
        m = _model()
        qgru.calibrate(m, _shard(data, rank), progress=False)
        qgru.sync_calibration(m)
        res["sync_twice"] = _err(lambda: qgru.sync_calibration(m))  # reduced already: no double count
        if rank == 0:
            with _Counting(forbid=True):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    m.convert(sync=False)
            res["sync_then_rank0"] = m.export().to_dict()
        dist.barrier()
        # convert(sync=False) without a sync: a warning, this rank's data alone
        m = _model()
        qgru.calibrate(m, data[rank::2], progress=False)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with _Counting(forbid=True):
                m.convert(sync=False)
        res["no_sync"] = (m.export().to_dict(), [str(x.message) for x in w])
        # an explicit group: a group of rank 0 alone reduces nothing (and waits for no one)
        solo = dist.new_group([0])
        if rank == 0:
            m = _model()
            qgru.calibrate(m, data[:2], progress=False)
            with _Counting(forbid=True):
                m.convert(group=solo)
            res["solo_group"] = m.export().to_dict()
        dist.barrier()
        # observers of another shape on the other rank (Observer.sync): a qgru error, not a gloo abort
        from qgru.observers import Observer
        o = Observer("o", "minmax", channels=2 if rank else 0)
        o.observe(torch.ones(3, 2) * (rank + 1))
        o.end_call()
        res["observer_mismatch"] = _err(o.sync)
        # convert on rank 0 alone without sync_calibration (a group with a 2 s timeout): a qgru error
        # saying what to do, not a silent wait (it waits for the group's timeout, then raises)
        short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
        if rank == 0:
            m = _model(observer="minmax")
            qgru.calibrate(m, data[:2], progress=False)
            res["rank0_alone"] = _err(lambda: m.convert(group=short))
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("qgru_dist"))


def _single(model: qgru.QuantGRU, batches) -> dict:
    qgru.calibrate(model, batches, progress=False)
    return model.convert().export().to_dict()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)


class TestShards:
    def test_uneven_shards_equal_one_process(self, ranks):
        """3 batches on rank 0, 1 on rank 1 (mse observers, gptq moments): both ranks convert to the
        integers one process calibrated on all 4 gets."""
        single = _single(_model(), _data())
        assert _equal(ranks[0]["uneven"], single) and _equal(ranks[1]["uneven"], single)
        assert not _equal(_single(_model(), _data()[:3]), single)  # the reduction matters

    def test_collectives_are_coalesced(self, ranks):
        """A bidirectional model (14 observers, 4 moments): one fingerprint all_gather and three
        reductions in all (each observer used to take 5 to 9 all_reduce of its own, each moment 2)."""
        for r in ranks:
            assert r["uneven_calls"] == {"all_gather": 1, "all_reduce": 3}
            # two QuantGRUs in quantize_model: still one fingerprint and three reductions
            assert r["quantize_model_calls"] == {"all_gather": 1, "all_reduce": 3}

    def test_quantize_model_equals_one_process(self, ranks):
        net = _Two()
        q = qgru.quantize_model(net, [(x,) for x in _data()], "w8a8", progress=False)
        single = [g.export().to_dict() for g in (q.a, q.b)]
        for r in ranks:
            assert all(_equal(a, b) for a, b in zip(r["quantize_model"], single))

    def test_empty_shard_joins_with_no_data(self, ranks):
        single = _single(_model(observer="minmax"), _data()[:2])
        assert _equal(ranks[0]["empty_shard"], single) and _equal(ranks[1]["empty_shard"], single)
        single = _single(_model(observer="ema"), _data()[:2])  # the mean over the ranks that saw data
        assert _equal(ranks[0]["empty_shard_ema"], single) and _equal(ranks[1]["empty_shard_ema"], single)

    def test_every_shard_empty_is_the_same_error_everywhere(self, ranks):
        msg = ranks[0]["all_empty"]
        assert msg.startswith("DistributedCalibrationError") and "no data on any of the 2 ranks" in msg
        assert ranks[1]["all_empty"] == msg
        with pytest.raises(ValueError, match="empty"):  # one process: calibrate() says so at once
            qgru.calibrate(_model(), [], progress=False)


class TestMismatch:
    @pytest.mark.parametrize("name, field, values", [
        ("hidden", "structure", ("hidden_size=4", "hidden_size=5")),
        ("layers", "structure", ("num_layers=1", "num_layers=2")),
        ("observer", "observer", ("'minmax'", "'ema'")),
        ("config", "config", ("'w8a8'", "'w8a16'")),
        ("scale_mode", "scale mode", ("'multiplier'", "'pow2'")),
        ("weights", "float weights", ("sha256", "sha256")),
    ])
    def test_every_rank_raises_naming_what_differs(self, ranks, name, field, values):
        msg = ranks[0][f"mismatch_{name}"]
        assert ranks[1][f"mismatch_{name}"] == msg  # the same error on every rank
        assert msg.startswith("DistributedCalibrationError") and "nothing was reduced" in msg
        part = next(p for p in msg.split(" | ") if field + ": rank 0:" in p)
        r0, r1 = part.split("; rank 1: ")
        assert values[0] in r0 and values[1] in r1

    def test_observer_sync_of_other_shapes(self, ranks):
        msg = ranks[0]["observer_mismatch"]
        assert msg.startswith("DistributedCalibrationError") and "statistics layout" in msg
        assert ranks[1]["observer_mismatch"] == msg


class TestConvertOnOneRank:
    def test_sync_then_convert_on_rank0_alone(self, ranks):
        """sync_calibration on every rank; then rank 0 converts with every collective forbidden (and
        no warning), to one process's integers on all the data."""
        m = _model()
        single = _single(m, _data())
        assert _equal(ranks[0]["sync_then_rank0"], single)
        assert ranks[0]["sync_twice"] == "no error" and ranks[1]["sync_twice"] == "no error"

    def test_sync_false_without_sync_warns_and_uses_own_data(self, ranks):
        for rank, r in enumerate(ranks):
            export, msgs = r["no_sync"]
            assert _equal(export, _single(_model(), _data()[rank::2]))
            assert any("sync=False" in m and "its own calibration data" in m for m in msgs), msgs

    def test_rank0_alone_is_a_qgru_error_saying_what_to_do(self, ranks):
        msg = ranks[0]["rank0_alone"]
        assert msg.startswith("DistributedCalibrationError") and "fingerprint all_gather" in msg
        assert "qgru.sync_calibration(model) on every rank" in msg and "convert(sync=False)" in msg

    def test_explicit_group(self, ranks):
        assert _equal(ranks[0]["solo_group"], _single(_model(), _data()[:2]))


# ---- the reduction's device, from the group's backend (one process, world size 1) ---------------
@pytest.fixture
def world1(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


class TestDevice:
    def test_device_of_the_group_backend(self, world1, monkeypatch):
        from qgru.distributed import comm_device
        assert comm_device() == torch.device("cpu")  # gloo: the CPU
        cuda_only = world1.new_group([0], backend="cuda:gloo")  # stands in for an NCCL group
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert comm_device(cuda_only) == torch.device("cuda", 0)
        assert comm_device(world1.new_group([0], backend="cpu:gloo,cuda:gloo")) == torch.device("cpu")

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: an NCCL group needs one")
    def test_cuda_nccl_group_converts_as_one_process(self, world1):
        """A real NCCL group (this one process, cuda:0): the statistics are reduced as CUDA tensors
        (comm_device says cuda) and the model converts to exactly the integers of a conversion
        without any group, for a CPU model and for one on the GPU."""
        from qgru.distributed import comm_device
        if not world1.is_nccl_available():
            pytest.skip("this torch has no NCCL backend")
        torch.cuda.set_device(0)
        nccl = world1.new_group([0], backend="nccl")
        assert comm_device(nccl) == torch.device("cuda", 0)
        want = _single(_model(), _data())
        for device in ("cpu", "cuda"):
            m = _model().to(device)
            qgru.calibrate(m, [x.to(device) for x in _data()], progress=False)
            m.convert(group=nccl)
            got = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in m.export().to_dict().items()}
            assert _equal(got, want), device

    def test_cuda_group_without_cuda_is_a_qgru_error(self, world1, monkeypatch):
        from qgru.distributed import comm_device
        cuda_only = world1.new_group([0], backend="cuda:gloo")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(qgru.DistributedCalibrationError, match="reduces only cuda tensors"):
            comm_device(cuda_only)


# ---- QAT: the frozen grids are in the state_dict; sharded weights --------------------------------
def _qat_train(model, opt, batches, steps):
    model.train()
    for i in range(steps):
        x = batches[i % len(batches)]
        loss = model(x)[0].square().mean() + (model(x)[0] - 0.3).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


class TestQATResume:
    def _fresh(self, batches):
        torch.manual_seed(3)
        net = nn.GRU(I, H, num_layers=2)
        return qgru.prepare_qat(net, batches, config="w8a8", progress=False)

    def test_resume_equals_uninterrupted_training(self, tmp_path):
        """Train 3 steps, save (model and optimizer), load into a fresh prepare_qat model calibrated on
        other batches (as a restarted job would), train 3 more: the same integers as 6 steps in one go."""
        data = _data()
        whole = self._fresh(data[:2])
        opt = torch.optim.Adam(whole.parameters(), lr=0.05)
        _qat_train(whole, opt, data, 3)
        torch.save({"model": whole.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
        _qat_train(whole, opt, data[3:] + data[:3], 3)
        ref = qgru.convert_qat(whole).export().to_dict()

        ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        assert any(k.startswith("_qat_x_min_l0") for k in ckpt["model"])

        def resumed(sd):
            m = self._fresh(data[2:])  # other calibration batches: other grids, unless the checkpoint's load
            o = torch.optim.Adam(m.parameters(), lr=0.05)
            m.load_state_dict(sd, strict=False)
            o.load_state_dict(ckpt["opt"])
            _qat_train(m, o, data[3:] + data[:3], 3)
            return qgru.convert_qat(m).export().to_dict()
        assert _equal(resumed(ckpt["model"]), ref)
        # without the grids (the weights alone, what a QAT state_dict held before) it is another model
        assert not _equal(resumed({k: v for k, v in ckpt["model"].items() if "_qat_" not in k}), ref)

    def test_grids_are_fixed_size_tensors_and_strict(self):
        m = self._fresh(_data()[:2])
        sd = m.state_dict()
        grids = {k: v for k, v in sd.items() if "_qat_" in k}
        assert grids and all(v.dtype == torch.float64 for v in grids.values())
        fresh = self._fresh(_data()[2:])
        fresh.load_state_dict(sd)  # strict: the same keys
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in grids.items())
        plain = qgru.QuantGRU(I, H, num_layers=2)  # not in QAT mode: the grids are unexpected keys
        with pytest.raises(RuntimeError, match="Unexpected key.*_qat_"):
            plain.load_state_dict(sd)
        bad = dict(sd, **{next(iter(grids)): torch.zeros(7, dtype=torch.float64)})
        with pytest.raises(RuntimeError, match="QAT grid"):
            self._fresh(_data()[2:]).load_state_dict(bad)
        gru_sd = nn.GRU(I, H, num_layers=2).state_dict()  # the float model's keys are unchanged
        assert set(sd) - set(grids) == set(gru_sd)

    @pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
    def test_distributed_checkpoint_round_trip(self, tmp_path):
        dcp = pytest.importorskip("torch.distributed.checkpoint")
        m = self._fresh(_data()[:2])
        dcp.save(m.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
        fresh = self._fresh(_data()[2:])
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
        fresh.load_state_dict(sd)
        assert _equal(qgru.convert_qat(fresh).export().to_dict(), qgru.convert_qat(m).export().to_dict())


class TestShardedWeights:
    def test_dtensor_weights_at_convert_qat(self, world1):
        tensor = pytest.importorskip("torch.distributed.tensor")
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1,))
        m = qgru.prepare_qat(nn.GRU(I, H), _data()[:2], progress=False)
        w = m.weight_hh_l0
        m.weight_hh_l0 = nn.Parameter(tensor.distribute_tensor(w.detach(), mesh, [tensor.Shard(0)]))
        with pytest.raises(qgru.ShardedWeightError, match=r"weight_hh_l0.*full_tensor"):
            qgru.convert_qat(m)
