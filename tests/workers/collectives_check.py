"""Every collective case on one world size, against torch.distributed and against exact expectations.

Launched by tests/test_collectives.py as `par.runtime.launch.run(this file, nproc=N)`. Each rank asserts
(a failure becomes a LaunchError carrying the traceback) and returns what the test asserts on too:
the number of cases checked and the bytes counted by par.comm.commlog per case.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import par.runtime.dist
from par.comm import collectives as C
from par.comm import commlog
from par.runtime import nccl_emulation

C.PIECE = 100  # elements per piece: small, so that chunks travel in several pieces (the last one shorter)
SIZES = [1, 2, 3, 5, 7, 64, 1001, 4096]
TORCH_SIZES = [1, 7, 12, 1001]   # 12: every world size divides it, the others not all
OPS = ("sum", "avg", "max")
REF_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def data(seed: int, rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    """What `rank` contributes in case `seed` (every rank can recompute anyone's data)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def expected_reduce(seed, members, numel, op, dtype):
    """The reduction computed locally from every member's data, in float64."""
    stack = torch.stack([data(seed, r, numel, torch.float64) for r in members])
    out = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0).values}[op]
    return out.to(dtype)


def close(got, want, what):
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


class Cases:
    def __init__(self, env, group=None, members=None):
        self.env, self.group = env, group
        self.members = members or list(range(env.world_size))
        self.n, self.me = len(self.members), self.members.index(env.rank)
        self.rows, self.checked = [], 0

    def mine(self, seed, numel, dtype=torch.float32):
        return data(seed, self.env.rank, numel, dtype).to(self.env.device)

    def logged(self, kind, fn):
        with commlog.capture() as log:
            out = fn()
        assert log.count() == 1 and log.count(kind) == 1, log.as_dicts()
        return out, log.events[0]

    def check_bytes(self, event, kind, numel, itemsize, impl):
        """The bytes that travel: the ring's exact count; torch's all-reduce as a ring; torch's
        reduce-scatter / all-gather with chunks padded to equal size, or (gloo) a whole all-reduce."""
        native = C.native_reduce_scatter(self.group)
        if impl == "ring" or kind == "all_reduce" or (kind == "reduce_scatter" and not native):
            exact = {"all_reduce": C.ring_all_reduce_bytes, "reduce_scatter": C.ring_reduce_scatter_bytes,
                     "all_gather": C.ring_all_gather_bytes}["all_reduce" if impl == "torch" else kind](
                numel, self.n, self.me, itemsize)
        else:
            exact = C.padded_chunk_bytes(numel, self.n, itemsize)
        assert event.bytes_sent == exact, (kind, impl, numel, event.bytes_sent, exact)
        assert (event.numel, event.group_size, event.impl) == (numel, self.n, impl), event
        self.rows.append({"kind": kind, "impl": impl, "native": native, "numel": numel, "itemsize": itemsize,
                          "n": self.n, "me": self.me, "bytes": event.bytes_sent})

    def all_reduce(self, seed, numel, op, impl, dtype=torch.float32, shape=None):
        t = self.mine(seed, numel, dtype)
        if shape:
            t = t.view(*shape)
        ref = t.clone()
        dist.all_reduce(ref, REF_OP[op], group=self.group)
        if op == "avg":
            ref /= self.n
        out, event = self.logged("all_reduce", lambda: C.all_reduce(t, op=op, group=self.group, impl=impl))
        assert out is t and t.shape == (shape or (numel,)), "all_reduce works in place"
        what = f"all_reduce {op} {impl} numel={numel} n={self.n}"
        close(t, ref, what + " vs torch.distributed")
        close(t.view(-1), expected_reduce(seed, self.members, numel, op, dtype), what + " vs local reduction")
        self.check_bytes(event, "all_reduce", numel, t.element_size(), impl)
        self.checked += 1

    def reduce_scatter(self, seed, numel, op, impl):
        t = self.mine(seed, numel)
        out, event = self.logged("reduce_scatter", lambda: C.reduce_scatter(t, op=op, group=self.group, impl=impl))
        a, b = C.chunk_bounds(numel, self.n)[self.me]
        assert out.numel() == b - a and (b == a or out.data_ptr() == t.view(-1)[a:].data_ptr()), \
            "reduce_scatter returns this rank's chunk as a view into the tensor"
        close(out, expected_reduce(seed, self.members, numel, op, torch.float32)[a:b],
              f"reduce_scatter {op} {impl} numel={numel} n={self.n}")
        self.check_bytes(event, "reduce_scatter", numel, 4, impl)
        self.checked += 1

    def all_gather(self, seed, numel, impl):
        bounds = C.chunk_bounds(numel, self.n)
        a, b = bounds[self.me]
        t = torch.full((numel,), -7.0, device=self.env.device)  # garbage outside my chunk
        t[a:b] = self.mine(seed, numel)[a:b]
        _, event = self.logged("all_gather", lambda: C.all_gather(t, group=self.group, impl=impl))
        want = torch.cat([data(seed, r, numel)[s:e] for r, (s, e) in zip(self.members, bounds)])
        assert torch.equal(t.cpu(), want), f"all_gather {impl} numel={numel} n={self.n}"
        self.check_bytes(event, "all_gather", numel, 4, impl)
        self.checked += 1

    def torch_cases(self):
        for seed, numel in enumerate(TORCH_SIZES):
            for op in OPS:
                self.all_reduce(seed, numel, op, "torch")
                self.reduce_scatter(seed, numel, op, "torch")
            self.all_gather(seed, numel, "torch")

    def everything(self):
        for seed, numel in enumerate(SIZES):
            for op in OPS:
                self.all_reduce(seed, numel, op, "ring")
                self.reduce_scatter(seed, numel, op, "ring")
            self.all_gather(seed, numel, "ring")
        self.torch_cases()
        # torch's native reduce-scatter (NCCL's path), run on gloo, which has it too
        C.NATIVE_REDUCE_SCATTER.add("gloo")
        try:
            for seed, numel in enumerate(TORCH_SIZES):
                for op in OPS:
                    self.reduce_scatter(seed, numel, op, "torch")
        finally:
            C.NATIVE_REDUCE_SCATTER.discard("gloo")
        self.all_reduce(99, 15, "sum", "ring", shape=(3, 5))
        self.all_reduce(98, 13, "max", "ring", dtype=torch.float64)
        self.all_reduce(97, 13, "sum", "torch", dtype=torch.float64)
        return {"members": self.members, "checked": self.checked, "rows": self.rows}


def check_trace(env):
    """on_step sees every step with the chunks the schedule names, and a reduce-scatter leaves chunk r summed."""
    n, r = env.world_size, env.rank
    numel = 2 * n + 1
    t = torch.full((numel,), float(r + 1), device=env.device)
    steps = []
    C.ring_all_reduce(t, on_step=lambda phase, k, sent, got, flat: steps.append((phase, k, sent, got, flat.clone())))
    assert [(p, k) for p, k, *_ in steps] == [("reduce_scatter", k) for k in range(n - 1)] + \
        [("all_gather", k) for k in range(n - 1)]
    a, b = C.chunk_bounds(numel, n)[r]
    full = n * (n + 1) / 2
    assert torch.all(steps[n - 2][4][a:b] == full), "after reduce-scatter my chunk is the full sum"
    for phase, k, sent, got, _ in steps:
        schedule = C.reduce_scatter_chunks if phase == "reduce_scatter" else C.all_gather_chunks
        assert (sent, got) == schedule(r, n, k)
    assert torch.all(t == full)
    return len(steps)


def check_errors(env):
    t = torch.ones(4, 6, device=env.device)[:, ::2]
    for call in (lambda: C.all_reduce(t), lambda: C.ring_all_reduce(torch.ones(3), op="min")):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError("bad input must raise ValueError")


def main():
    env = par.runtime.dist.init()
    n = env.world_size
    result = {"world_size": n, "ranks": None}
    mine = {"world": Cases(env).everything(), "trace_steps": check_trace(env),
            "nccl_emulation": dist.batch_isend_irecv is nccl_emulation.batch_isend_irecv}
    check_errors(env)
    # subgroups: every rank must create every group, in the same order
    subgroups = {2: [[1, 0]], 3: [[0, 2]], 4: [[1, 3], [0, 2, 3]]}[n]
    for members in subgroups:
        group = dist.new_group(members)
        if env.rank in members:
            mine[f"group {members}"] = Cases(env, group, sorted(members)).everything()
    result["ranks"] = par.runtime.dist.gather_object(mine)
    par.runtime.dist.save_result(result)
    par.runtime.dist.teardown()


if __name__ == "__main__":
    main()
