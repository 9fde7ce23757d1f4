"""The pipeline runtime: every rank executes its part of a `Schedule`'s communication plan.

Setup. The layer list (`model.to_layers()`) is cut into p·v stages (`par.pp.partition`);
rank r keeps the stages the schedule places on it (its chunks: r, r+p, ... or, in a V, r and 2p-1-r). Before the first step the ranks agree on
the shape of every activation that crosses a stage boundary: the owner of stage k runs
it once on a dummy input and broadcasts the output's shape.

One step = the rank's actions, in order:

    F(i) on stage k:  x = activation i from stage k-1           (stage 0: micro-batch i of the batch)
                      y = stage(x)                                keep x, y for the backward
                      y goes to stage k+1                        (last stage: loss_i = loss(y, t_i) / m)
    B(i) on stage k:  g = d loss / d y from stage k+1            (last stage: backward of loss_i)
                      y.backward(g)                              parameter .grad accumulates
                      x.grad goes to stage k-1

Because loss_i is divided by m and .grad accumulates over the micro-batches, the
gradients equal those of one process training on the whole batch: ∇(1/m Σ loss_i).

Zero-bubble schedules (`par.pp.schedules.zb_h1`, `zb_v`, `dualpipe_v`) split B into I and W
(`_Step.backward_input`, `_Step.backward_weight`):

    F(i), split:      as F, and remember where every layer that owns weights put its output y_l
                      (a `GradientEdge`: a place in the autograd graph, not the tensor)
    I(i) on stage k:  dL/dx and every dL/dy_l in one autograd.grad(out, [x, y_1, ...], g, retain_graph=True):
                      a backward that skips every weight gradient; dL/dx goes to stage k-1 at once
    W(i) on stage k:  for each weight layer l: dL/dθ_l = autograd.grad(y_l, θ_l, dL/dy_l), added to .grad:
                      only that layer's own local backward, nothing recomputed; for a Linear
                      .grad += g_lᵀ x_l in place (`linear_weight_gradients`), x_l the input autograd saved

The price: W needs what autograd saved in F (x_l for g_lᵀ x_l), so the graph stays alive until W, not
until I, and dL/dy_l of every weight layer waits beside it (`_MemoryMeter` counts both).

Communication. The sends and receives between the actions follow the plan of
`par.pp.p2p_plan.build(schedule)`, the very plan `par.pp.sim.check` replayed under NCCL's rule
(groups posted together with one `batch_isend_irecv`; sends that block until matched). The
runtime keeps one group in flight: it posts a group, goes on computing, and waits for every
Work of that group before the first action that reads a tensor it receives, before posting
the next group, and at the end of the step. `executed` lists the groups of the last step as
they were posted, so a test can compare them with the plan.

A `par.timeline.Recorder` passed to `step` gets one span per action ("F3", "B3@1") on
every rank (and, with `record_comm`, one "wait" span per blocking wait in lane "comm"); its
`gather()` brings the timeline to rank 0. `cpu_s` holds what each action of the last step cost
(`ActionCosts`): on the CPU its thread's CPU time (`time.thread_time()`), what the action cost when ranks
share cores and wall time does not tell; on a GPU the seconds between CUDA events around it. `after_s` holds,
for each action, what the rank spent from its end to the start of its next action less what it spent blocked
waiting for a group (0 after the last), on the CPU clocks of `par.clock` ({"wall", "steady", "cpu"}): the time a
rank spends between actions on its own (posting messages, Python), which `par.pp.sim.as_executed` adds back when
it rebuilds the step from each rank's own time.
"""
from __future__ import annotations

import itertools
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from par import clock
from par.comm import collectives, commlog
from par.memory.accounting import saved_tensors_seen
from par.pp import partition, sim as pipeline_sim
from par.pp.p2p_plan import Group, message_in
from par.pp.schedules import Action, Schedule, from_lists, parse_action
from par.runtime import dist as pdist
from par.timeline import Mark

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
MAX_DIMS = 8


class PipelineError(ValueError):
    """Bad pipeline input: one line that names the numbers and the fix."""


def split_microbatches(batch: torch.Tensor, m: int) -> list[torch.Tensor]:
    """The batch cut along dimension 0 into m equal micro-batches."""
    if batch.size(0) % m:
        lower, upper = (batch.size(0) // m) * m, (batch.size(0) // m + 1) * m
        raise PipelineError(f"a batch of {batch.size(0)} rows does not split into {m} equal micro-batches: "
                            f"use a batch divisible by {m} (e.g. {lower or upper} or {upper}) "
                            f"or a number of micro-batches that divides {batch.size(0)}")
    return list(batch.split(batch.size(0) // m))


class ActionCosts:
    """What each action of a step cost, in seconds.

    On the CPU: this thread's CPU time in the action (`time.thread_time()`). On a GPU that would read ≈ 0:
    the thread only launches kernels, and backward's run on autograd's device thread. There the cost is the
    time between two CUDA events recorded on the current stream before and after the action (the GPU's time
    from the moment it could start the action to the end of its last kernel), read after the step.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = {}     # action -> (start, end): CPU seconds or CUDA events

    def _event(self):
        """A timing event recorded now on the current stream (a test can replace it)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _now(self):
        return self._event() if self.cuda else time.thread_time()

    @contextmanager
    def action(self, name: str):
        start = self._now()
        yield
        self.marks[name] = (start, self._now())

    def seconds(self) -> dict:
        """{action: seconds}; on a GPU after the last event (all on one stream, so every earlier one) happened."""
        if not self.cuda:
            return {name: end - start for name, (start, end) in self.marks.items()}
        if self.marks:
            next(reversed(self.marks.values()))[1].synchronize()
        return {name: start.elapsed_time(end) / 1e3 for name, (start, end) in self.marks.items()}


class Pipeline:
    """This rank's part of a pipeline-parallel model and the schedule it runs.

    layers    the whole model as a list of modules (every rank passes the same list)
    schedule  a `par.pp.schedules.Schedule` for p ranks (p = size of `ranks`, default the world)
    loss_fn   loss_fn(output, target) -> mean loss of a micro-batch, applied on the last stage
    method    'parameters' (balanced parameter counts) or 'uniform' layer counts
    ranks     global ranks of the p pipeline ranks (default 0..p-1), for DP x PP layouts,
    group     with `ranks`: a process group of exactly those ranks (`dist.new_group(ranks)`)
    """

    def __init__(self, layers, schedule: Schedule, loss_fn, method: str = "parameters",
                 ranks=None, group=None, device=None, track_memory: bool = False):
        layers = list(layers)
        self.plan = pipeline_sim.verified_plan(schedule)
        self.schedule = schedule
        self.p, self.v, self.m = schedule.num_ranks, schedule.virtual, schedule.microbatches
        self.ranks = list(ranks) if ranks is not None else list(range(self.p))
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(self.ranks) != self.p:
            raise PipelineError(f"the schedule is for {self.p} ranks but {len(self.ranks)} were given")
        if ranks is not None and world != self.p and group is None:
            raise PipelineError(f"a pipeline on ranks {self.ranks} of {world} needs its own process group: "
                                f"pass group=dist.new_group({self.ranks})")
        self.group = group
        if ranks is None and world != self.p:
            raise PipelineError(f"the schedule is for {self.p} ranks but the job has {world}: "
                                f"launch {self.p} ranks or build the schedule for {world}")
        me = dist.get_rank() if dist.is_initialized() else 0
        if me not in self.ranks:
            raise PipelineError(f"rank {me} is not one of the pipeline's ranks {self.ranks}")
        self.rank = self.ranks.index(me)  # this rank's place in the pipeline
        self.bounds = partition.bounds_for(layers, self.p * self.v, method)
        self.device = torch.device(device) if device is not None else _default_device(layers)
        self.chunks = [nn.Sequential(*layers[slice(*self.bounds[self.stage_of(c)])]).to(self.device)
                       for c in range(self.v)]
        self.weight_layers = [weight_layers(chunk) for chunk in self.chunks]
        self.loss_fn = loss_fn
        self.track_memory = track_memory
        self._shapes = {}
        self.memory = {}
        self.executed = []   # the last step's groups as posted: [[(kind, peer, message), ...], ...]
        self.cpu_s = {}      # the last step's cost per action (`ActionCosts`): {"F3": 0.012, ...}
        self.after_s = {}    # the last step's seconds after each action, before the next, not waiting, by clock

    # ------------------------------------------------------------ bookkeeping
    @property
    def last_rank(self) -> int:
        """Pipeline rank that holds the last stage (and so knows the loss)."""
        return self.schedule.owner(self.p * self.v - 1)[0]

    def stage_of(self, chunk: int) -> int:
        """Global stage of this rank's chunk `chunk` (chunk·p + rank, or the schedule's V placement)."""
        return self.schedule.stage_of(self.rank, chunk)

    def parameters(self):
        return itertools.chain.from_iterable(c.parameters() for c in self.chunks)

    def named_parameters(self):
        """(name, parameter) with names of the whole layer list: '<layer index>.<name in the layer>'."""
        for c, chunk in enumerate(self.chunks):
            first = self.bounds[self.stage_of(c)][0]
            for name, param in chunk.named_parameters():
                i, rest = name.split(".", 1)
                yield f"{first + int(i)}.{rest}", param

    # ------------------------------------------------------------ shapes
    def _boundary_shapes(self, x0: torch.Tensor) -> list[tuple]:
        """(shape, dtype) of the output of every stage but the last, for micro-batch input x0.

        Stage k's owner runs it on a dummy input of stage k's shape and broadcasts the result.
        """
        key = (tuple(x0.shape), x0.dtype)
        if key in self._shapes:
            return self._shapes[key]
        shapes, inp = [], (tuple(x0.shape), x0.dtype)
        with commlog.tag("pipeline shapes"):
            for k in range(self.p * self.v - 1):
                owner, chunk = self.schedule.owner(k)
                code = torch.zeros(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
                if owner == self.rank:
                    dummy = x0 if k == 0 else torch.zeros(inp[0], dtype=inp[1], device=self.device)
                    with torch.no_grad():
                        out = self.chunks[chunk](dummy.to(self.device))
                    code[0], code[1] = out.dim(), DTYPES.index(out.dtype)
                    code[2:2 + out.dim()] = torch.tensor(out.shape)
                if self.p > 1:
                    collectives.broadcast(code, src=self.ranks[owner], group=self.group)
                n = int(code[0])
                inp = (tuple(int(d) for d in code[2:2 + n]), DTYPES[int(code[1])])
                shapes.append(inp)
        self._shapes[key] = shapes
        return shapes

    def _buffer(self, message, shapes) -> torch.Tensor:
        """An empty tensor for `message`: an activation (output of stage k) or a gradient (input of stage k)."""
        what, _, stage = message
        shape, dtype = shapes[stage] if what == "activation" else shapes[stage - 1]
        return torch.empty(shape, dtype=dtype, device=self.device)

    # ------------------------------------------------------------ one step
    def step(self, x: torch.Tensor, y: torch.Tensor, recorder=None, record_comm: bool = False):
        """Forward and backward of the batch (x, y) by the plan; gradients accumulate in .grad.

        Returns the batch's mean loss on the rank holding the last stage, None elsewhere.
        """
        run = _Step(self, split_microbatches(x, self.m), split_microbatches(y, self.m))
        span = recorder.span if recorder is not None else (lambda *a, **k: nullcontext())
        run.waiting = (lambda: span("wait", lane="comm")) if record_comm else nullcontext
        done = None                                   # (the last action, the rank's clocks when it ended)
        with commlog.tag("pipeline"):
            for item in self.plan.ranks[self.rank]:
                if isinstance(item, Group):
                    run.post(item)
                    continue
                run.wait_for(item)
                start = recorder.mark() if recorder is not None else None
                if done is not None:          # from the last action's span to this one's
                    run.after(*done, _reading(start))
                run.waited = (0.0, 0.0, 0.0)
                with run.costs.action(str(item)):
                    {"F": run.forward, "B": run.backward, "I": run.backward_input, "W": run.backward_weight}[
                        item.kind](item)
                end = recorder.mark() if recorder is not None else None
                done = (str(item), _reading(end))
                if recorder is not None:
                    recorder.add(str(item), start, end)
            run.wait()
        if done is not None:
            run.after_s[done[0]] = {"wall": 0.0, "steady": 0.0, "cpu": 0.0}
        if run.saved or run.inbox or run.outbox or run.weights_owed:
            raise RuntimeError(f"rank {self.rank}: step ended with work left: saved {sorted(run.saved)}, "
                               f"weight gradients owed {sorted(run.weights_owed)}, "
                               f"unread messages {sorted(run.inbox)}, unsent {sorted(run.outbox)}")
        self.executed, self.cpu_s = run.executed, run.costs.seconds()
        self.after_s = run.after_s
        if run.mem:
            self.memory = run.mem.summary()
        return float(run.loss) if run.loss is not None else None


def _reading(mark) -> clock.Reading:
    """The thread's clocks at a recorder's mark (a CPU `par.timeline.Mark`), else now (no recorder, a CUDA event)."""
    return mark.reading if isinstance(mark, Mark) else clock.read()


class _Step:
    """The state of one step on one rank: what is saved for backward, what arrived, what waits to be sent."""

    def __init__(self, pipe: Pipeline, xs, ys):
        self.pipe, self.xs, self.ys = pipe, xs, ys
        self.shapes = pipe._boundary_shapes(xs[0].to(pipe.device))
        self.last = pipe.p * pipe.v - 1
        self.saved = {}                   # (micro-batch, stage) -> (input, output or loss, weight layers' outputs)
        self.weights_owed = {}            # (micro-batch, stage) -> (weight layers' outputs, dL/d those), I done, W not
        self.split = {(a.microbatch, a.chunk) for a in pipe.schedule.ranks[pipe.rank] if a.kind == "I"}
        self.inbox = {}                   # message -> tensor received (and waited for) or handed over locally
        self.outbox = {}                  # message -> tensor computed here, waiting for its group
        self.in_flight = None             # (works, {message: buffer}, tensors sent) of the group posted last
        self.executed, self.costs = [], ActionCosts(pipe.device)
        self.waiting = nullcontext
        self.waited = (0.0, 0.0, 0.0)     # (wall, cpu, ready) seconds in `wait` since the last action ended
        self.after_s = {}                 # action -> {clock: seconds after it, before the next action, not waiting}
        self.loss = None
        self.mem = _MemoryMeter(pipe.parameters()) if pipe.track_memory else None

    def post(self, group: Group) -> None:
        """Post `group` as one batch (after the previous group completed); do not wait for it."""
        self.wait()
        ranks = self.pipe.ranks
        sends = [(self.outbox.pop(op.message), ranks[op.peer]) for op in group.sends]
        buffers = {op.message: self.pipe._buffer(op.message, self.shapes) for op in group.recvs}
        recvs = [(buffers[op.message], ranks[op.peer]) for op in group.recvs]
        works = collectives.send_recv(sends, recvs, self.pipe.group)
        self.in_flight = (works, buffers, sends)
        self.executed.append([(op.kind, op.peer, op.message) for op in group.sends]
                             + [(op.kind, op.peer, op.message) for op in group.recvs])

    def wait(self) -> None:
        """Wait for every Work of the group in flight; only then are its received tensors valid."""
        if self.in_flight is None:
            return
        works, buffers, _ = self.in_flight
        start = clock.read()
        with self.waiting():
            for work in works:
                work.wait()
        took = clock.since(start)
        self.waited = (self.waited[0] + took.wall, self.waited[1] + took.cpu, self.waited[2] + took.ready)
        self.inbox.update(buffers)
        self.in_flight = None

    def after(self, action: str, ended: clock.Reading, began: clock.Reading) -> None:
        """Keep the seconds from `action`'s end to the next action's start, less those spent in `wait` for a group:
        what this rank spent between two actions on its own (posting messages, Python), on the wall, steady and
        CPU clocks."""
        took, (wall, cpu, ready) = clock.between(ended, began), self.waited
        self.after_s[action] = {"wall": max(0.0, took.wall - wall), "cpu": max(0.0, took.cpu - cpu),
                                "steady": max(0.0, (took.wall - took.ready) - (wall - ready))}

    def wait_for(self, a) -> None:
        """Before action `a`: wait for the group in flight if it brings `a`'s input."""
        need = message_in(self.pipe.schedule, self.pipe.rank, a)
        if need is not None and self.in_flight is not None and need[0] in self.in_flight[1]:
            self.wait()

    def forward(self, a) -> None:
        """x = input (micro-batch or received activation); y = stage(x); send y, or loss_i / m on the last stage."""
        pipe, k = self.pipe, self.pipe.stage_of(a.chunk)
        if k == 0:
            inp = self.xs[a.microbatch].to(pipe.device)
            if inp.requires_grad:     # a batch that asks for its gradient: the micro-batch is a leaf whose .grad B
                inp = inp.detach().requires_grad_(True)   # and I compute (no stage before to send it to)
        else:
            inp = self.inbox.pop(("activation", a.microbatch, k - 1))
            if inp.is_floating_point():
                inp.requires_grad_(True)
        split = (a.microbatch, a.chunk) in self.split
        with self.mem.forward(a.microbatch, k) if self.mem else nullcontext(), \
                output_edges(pipe.weight_layers[a.chunk] if split else []) as edges:
            out = pipe.chunks[a.chunk](inp)
            if k == self.last:
                out = pipe.loss_fn(out, self.ys[a.microbatch].to(pipe.device)) / pipe.m
        self.saved[(a.microbatch, k)] = (inp, out, edges)
        if k == self.last:
            self.loss = out.detach() if self.loss is None else self.loss + out.detach()
        else:
            self.hand_over(("activation", a.microbatch, k), out.detach(), k + 1)

    def backward(self, a) -> None:
        """y.backward(dL/dy) (the loss's own backward on the last stage); send x.grad to the stage before."""
        k = self.pipe.stage_of(a.chunk)
        inp, out, _ = self.saved.pop((a.microbatch, k))
        if k == self.last:
            out.backward()
        else:
            out.backward(self.inbox.pop(("gradient", a.microbatch, k + 1)))
        if self.mem:
            self.mem.backward(a.microbatch, k)
        if k > 0:
            self.hand_over(("gradient", a.microbatch, k), inp.grad, k - 1)

    def backward_input(self, a) -> None:
        """I: dL/dx for the stage before (sent at once) and dL/dy_l for this stage's W (`input_gradients`)."""
        k = self.pipe.stage_of(a.chunk)
        inp, out, edges = self.saved.pop((a.microbatch, k))
        grad = None if k == self.last else self.inbox.pop(("gradient", a.microbatch, k + 1))
        dx, dys = input_gradients(out, grad, inp if inp.requires_grad else None, edges)
        self.weights_owed[(a.microbatch, k)] = (edges, dys)
        if self.mem:
            self.mem.keep(a.microbatch, k, dys)
        if k > 0:
            self.hand_over(("gradient", a.microbatch, k), dx, k - 1)

    def backward_weight(self, a) -> None:
        """W: every weight layer's dL/dθ from its saved dL/dy_l, added to .grad (`weight_gradients`)."""
        k = self.pipe.stage_of(a.chunk)
        edges, dys = self.weights_owed.pop((a.microbatch, k))
        weight_gradients(edges, dys)
        if self.mem:
            self.mem.backward(a.microbatch, k)

    def hand_over(self, message, tensor, stage) -> None:
        """`tensor` for the owner of `stage`: into this rank's inbox if it owns it, else out with the plan's next group."""
        if self.pipe.schedule.owner(stage)[0] == self.pipe.rank:
            self.inbox[message] = tensor.detach()
        else:
            self.outbox[message] = tensor.detach().contiguous()


def weight_layers(module: nn.Module) -> list[nn.Module]:
    """The modules inside `module` that own parameters themselves (Linear, LayerNorm, Embedding, ...)."""
    return [m for m in module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


@contextmanager
def output_edges(layers):
    """Collect [(layer, GradientEdge of its output, its input x if it is an nn.Linear)] of every call of
    `layers` inside the block.

    A `GradientEdge` names the place in the autograd graph where the output's gradient arrives,
    without holding the output tensor itself. A Linear's input is the tensor autograd saved for its
    weight gradient anyway (no extra memory); W uses it to add g_lᵀ x_l to .grad in place.
    """
    edges = []

    def hook(layer, args, out):
        x = args[0] if type(layer) is nn.Linear and args and isinstance(args[0], torch.Tensor) else None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                edges.append((layer, torch.autograd.graph.get_gradient_edge(t), x))

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield edges
    finally:
        for h in handles:
            h.remove()


def input_gradients(out, grad, inp, edges):
    """I: (dL/d inp, [dL/dy_l for every weight layer's output]) in one backward pass that computes no
    weight gradient (autograd runs only what the requested gradients need); the graph is retained for W.
    `inp` None (the first stage: token ids) asks for the dL/dy_l only."""
    wanted = ([inp] if inp is not None else []) + [edge for _, edge, _ in edges]
    if not wanted:
        return None, []
    grads = torch.autograd.grad(out, wanted, grad, retain_graph=True, allow_unused=True)
    return (grads[0], list(grads[1:])) if inp is not None else (None, list(grads))


def weight_gradients(edges, dys) -> None:
    """W: for each weight layer l, dL/dθ_l = (dy_l/dθ_l)ᵀ dL/dy_l, added to θ_l.grad.

    A Linear (y = x Aᵀ + b): dL/dA = gᵀx and dL/db = Σ g, with g = dL/dy_l and x its saved input, added
    to .grad in place (`linear_weight_gradients`: one addmm_, no new weight-sized tensor). Any other layer:
    autograd.grad from the layer's output edge to its own parameters, which runs that layer's local
    backward only.
    """
    for (layer, edge, x), dy in zip(edges, dys):
        params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
        if dy is None or not params:
            continue
        if linear_weight_gradients(layer, x, dy):
            continue
        for param, g in zip(params, torch.autograd.grad(edge, params, dy, retain_graph=True, allow_unused=True)):
            if g is not None:
                param.grad = g if param.grad is None else param.grad.add_(g)     # .grad += g


def linear_weight_gradients(layer, x, dy) -> bool:
    """For an nn.Linear with its input x and output gradient g = dy: A.grad += gᵀx, b.grad += Σ g (rows of
    every leading dimension), in place. False (nothing done) where that does not apply, left to autograd: not
    exactly an nn.Linear (a subclass may do more in its forward), no saved input, or tensors of different dtypes
    or devices (autocast)."""
    if type(layer) is not nn.Linear or x is None or not layer.weight.requires_grad:
        return False
    weight, bias = layer.weight, layer.bias
    if len({x.dtype, dy.dtype, weight.dtype}) > 1 or len({x.device, dy.device, weight.device}) > 1:
        return False
    g2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        weight.grad = g2.t().mm(x2) if weight.grad is None else weight.grad.addmm_(g2.t(), x2)    # += gᵀx
        if bias is not None and bias.requires_grad:
            bias.grad = g2.sum(0) if bias.grad is None else bias.grad.add_(g2.sum(0))            # += Σ g
    return True


def _default_device(layers) -> torch.device:
    try:
        return pdist.env().device
    except RuntimeError:
        for layer in layers:
            for p in getattr(layer, "parameters", lambda: [])():
                return p.device
    return torch.empty(0).device


class _MemoryMeter:
    """Bytes of activations autograd keeps for backward, per micro-batch in flight (parameters excluded).

    Counted with saved-tensor hooks (`par.memory.accounting.saved_tensors_seen`), so it works on any device:
    a tensor saved by several operations is counted once. A split backward keeps them until W, and from I on also the dL/dy_l W will need (`keep`; their largest
    sum per micro-batch is `bytes_kept_for_w`): an upper bound, as what only ops after the stage's last
    weight layer saved (the loss's softmax) is freed at I already.
    `summary()` gives the peak over the step.
    """

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = {}      # (micro-batch, stage) -> {storage: bytes}
        self.held = self.peak = 0
        self.in_flight = self.peak_in_flight = 0
        self.per_microbatch = []
        self.kept_for_w = 0
        self.per_stage = {}         # stage -> (largest activations of one micro-batch, largest dL/dy_l kept for W)

    @contextmanager
    def forward(self, mb: int, stage: int):
        """Count what autograd saves inside the block as micro-batch `mb`'s activations on `stage`."""
        storages = {}

        def see(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params and ptr not in storages:
                storages[ptr] = t.untyped_storage().nbytes()

        with saved_tensors_seen(see):
            yield
        self.live[(mb, stage)] = storages
        got = sum(storages.values())
        self.per_microbatch.append(got)
        act, kept = self.per_stage.get(stage, (0, 0))
        self.per_stage[stage] = (max(act, got), kept)
        self.held += got
        self.in_flight += 1
        self.peak = max(self.peak, self.held)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def keep(self, mb: int, stage: int, tensors) -> None:
        """After I: micro-batch `mb` on `stage` also holds `tensors` (the dL/dy_l) until its W."""
        storages, added = self.live[(mb, stage)], 0
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in storages:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                added += t.untyped_storage().nbytes()
        self.kept_for_w = max(self.kept_for_w, added)
        act, kept = self.per_stage[stage]
        self.per_stage[stage] = (act, max(kept, added))
        self.held += added
        self.peak = max(self.peak, self.held)

    def backward(self, mb: int, stage: int) -> None:
        """After B (or W): the micro-batch's activations are free."""
        self.held -= sum(self.live.pop((mb, stage)).values())
        self.in_flight -= 1

    def summary(self) -> dict:
        return {"peak_bytes": self.peak, "peak_in_flight": self.peak_in_flight,
                "bytes_per_microbatch": max(self.per_microbatch, default=0), "bytes_kept_for_w": self.kept_for_w,
                "per_stage": {s: {"activations": a, "kept_for_w": k} for s, (a, k) in sorted(self.per_stage.items())}}


# ---------------------------------------------------------------- what each action costs
# What each action of a stage costs, measured in one process: the numbers the simulator needs.
#
# On a machine with fewer cores than ranks, the wall clock of a p-rank run times the waiting for a core,
# not the schedule. So measure every stage on one rank instead: `measure_costs(layers, stages, x, y, loss_fn)`
# cuts the layers into `stages` chunks of a one-rank `Pipeline` and runs, micro-batch after
# micro-batch, the forward through every chunk, then the backward: split (I, then W) for the first
# micro-batches, whole (B) for the rest. Each action's cost is its thread's CPU time (`ActionCosts`), with
# torch on one thread while measuring, so no work hides on another core. The memory meter gives each
# stage's activations per micro-batch and the dL/dy_l its W keeps.
#
#     costs = measure_costs(layers, 2 * p, x, y, lm_loss)       # 2p chunks: a V schedule's stages
#     sim.simulate(schedules.zb_v(p, m), **costs.simulator())
#     sim.simulate(schedules.zb_h1(p, m), **costs.merged(2).simulator())   # p stages of two chunks each


def measuring_schedule(stages: int, m: int, whole: int) -> Schedule:
    """One rank, `stages` chunks: for each micro-batch F@0 .. F@(stages-1), then its backward from the last
    chunk down, split (I, W) for the first m - whole micro-batches and whole (B) for the last `whole`."""
    acts = []
    for mb in range(m):
        acts += [Action("F", mb, c) for c in range(stages)]
        for c in reversed(range(stages)):
            acts += [Action("B", mb, c)] if mb >= m - whole else [Action("I", mb, c), Action("W", mb, c)]
    return from_lists([acts], m, stages, name="measure")


@dataclass(frozen=True)
class StageCosts:
    """Per stage: median seconds of F, B, I, W, and the bytes a micro-batch holds (activations, from F to B
    or W) and adds at I (the dL/dy_l kept for W)."""
    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    activations: list[int]
    kept_for_w: list[int]

    def merged(self, k: int) -> "StageCosts":
        """Every k consecutive stages as one: the costs of a pipeline with k times fewer, longer stages."""
        def group(xs):
            return [sum(xs[i:i + k]) for i in range(0, len(xs), k)]
        return StageCosts(*(group(getattr(self, f)) for f in self.__dataclass_fields__))

    def uniform(self) -> "StageCosts":
        """Every stage the median of the measured ones: the equal stages the bubble formulas assume
        (a real model's first and last stages also embed and compute the loss)."""
        return StageCosts(*([statistics.median(getattr(self, f))] * len(self.forward)
                            for f in self.__dataclass_fields__))

    def simulator(self) -> dict:
        """The keyword arguments of `par.pp.sim.simulate` with these costs."""
        return {"forward": self.forward, "backward": self.backward, "backward_input": self.backward_input,
                "backward_weight": self.backward_weight}


def measure_costs(layers, stages: int, x: torch.Tensor, y: torch.Tensor, loss_fn, m: int = 5, whole: int = 2,
            method: str = "parameters") -> StageCosts:
    """Cut `layers` into `stages` chunks on one rank and time every chunk's F, B, I, W (module docstring).

    The first micro-batch warms up (its actions are not counted); the medians are over the others.
    """
    if not 0 < whole < m - 1:
        raise ValueError(f"measuring needs micro-batches split into I/W and whole (B) after a warm-up one: "
                         f"use 0 < whole < m - 1, got m={m}, whole={whole}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = Pipeline(layers, measuring_schedule(stages, m, whole), loss_fn, method=method, track_memory=True)
        pipe.step(x, y)
    finally:
        torch.set_num_threads(threads)
    samples = {}
    for name, seconds in pipe.cpu_s.items():
        a = parse_action(name)
        if a.microbatch > 0:
            samples.setdefault((a.kind, a.chunk), []).append(seconds)
    per_stage = pipe.memory["per_stage"]
    return StageCosts(*([statistics.median(samples[(k, c)]) for c in range(stages)] for k in "FBIW"),
                      [per_stage[c]["activations"] for c in range(stages)],
                      [per_stage[c]["kept_for_w"] for c in range(stages)])
