"""The data that crosses between the grader and the student's kernel: plain values, encoded the same on both sides.

    encode(x) -> JSON-able      decode(y) -> x              (in the grader: `par.course.grading.codec.encode`/`decode`)
    KERNEL_HELPER                                           (the same codec and the comm target, run in the kernel)

Data is what JSON holds, plus tuples, dicts with any plain keys, floats inf/nan, tensors (dtype, shape, values,
and whether they require grad), and a few of par's plain records (`_PAR_TYPES`: a GPT config, a planner's
Workload and Hardware), rebuilt by the receiver's own class. A planner's Plan crosses as a claim (its layout:
`_PLAN_KEYS`); the grader computes the plan itself (`par.course.grading.proxies.Session`). Each side decodes into its
own objects, so nothing the student returns has behaviour (an object equal to everything arrives as an error).
"""
from __future__ import annotations

# The codec, run both in the grader and in the kernel (so both sides speak the same data).
CODEC = r'''
# par's plain records that cross as their fields (rebuilt by the other side's own class: no behaviour of the
# sender's), and the fields that name a planner's plan (the grader recomputes the rest: `Session._plans`)
_PAR_TYPES = ("par.model.GPTConfig", "par.train.planner.Workload", "par.train.planner.Hardware")
_PLAN_KEYS = ("dp", "pp", "tp", "zero_stage", "microbatches", "offload", "cp")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_MAX_VALUES = 1 << 21   # values in one answer: each takes 2 characters or more, and the grader reads 4 MB (MAX_REPLY)


def _values_left(x, budget, depth=0):
    """`budget` less the values `x` holds (a tensor: its elements), counted until it is spent (then below 0)."""
    if type(x) in (list, tuple):
        budget -= len(x)
        for v in x:
            if budget < 0 or depth > 64:
                break
            if type(v) in (list, tuple, dict) or type(v).__module__.startswith("torch"):
                budget = _values_left(v, budget, depth + 1)
        return budget
    if type(x) is dict:
        return _values_left([*x.keys(), *x.values()], budget, depth)
    numel = getattr(x, "numel", None)
    return budget - numel() if callable(numel) and type(x).__module__.startswith("torch") else budget


def _encode(x, depth=0):
    if depth > 64:
        raise ValueError("the value is nested too deeply to be graded")
    if x is None or type(x) in (bool, int, str, float):
        return x
    if type(x) is list:
        return [_encode(v, depth + 1) for v in x]
    if type(x) is tuple:
        return {"__tuple__": [_encode(v, depth + 1) for v in x]}
    if type(x) is dict:
        return {"__dict__": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in x.items()]}
    module = type(x).__module__ or ""
    name = module + "." + type(x).__qualname__
    if name in _PAR_TYPES:
        import dataclasses
        return {"__par__": [name, [[f.name, _encode(getattr(x, f.name), depth + 1)] for f in dataclasses.fields(x)]]}
    if name == "par.train.planner.Plan":    # a claim: which plan; the grader computes the plan itself
        return {"__plan__": [[k, _encode(getattr(x, k), depth + 1)] for k in _PLAN_KEYS]}
    if module.startswith("torch"):
        import torch
        if type(x) is torch.Size:
            return {"__tuple__": [int(v) for v in x]}
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            dtype = str(t.dtype).replace("torch.", "")
            if dtype not in _DTYPES:
                raise TypeError(f"a tensor of dtype {dtype} cannot be graded")
            body = [dtype, [int(s) for s in t.shape], t.reshape(-1).tolist()]
            return {"__tensor__": body + [True] if x.requires_grad else body}
    if module == "numpy":
        return _encode(x.tolist(), depth + 1)
    raise TypeError(f"the grader takes plain data (numbers, strings, lists, tuples, dicts, tensors), "
                    f"not a {type(x).__module__}.{type(x).__qualname__}")


def _decode(y, depth=0):
    if depth > 64:
        raise ValueError("the value is nested too deeply to be graded")
    if y is None or type(y) in (bool, int, str, float):
        return y
    if type(y) is list:
        return [_decode(v, depth + 1) for v in y]
    if type(y) is dict and len(y) == 1:
        (tag, body), = y.items()
        if tag == "__tuple__" and type(body) is list:
            return tuple(_decode(v, depth + 1) for v in body)
        if tag == "__dict__" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("a malformed dict")
                out[_decode(pair[0], depth + 1)] = _decode(pair[1], depth + 1)
            return out
        if tag == "__par__" and type(body) is list and len(body) == 2 and body[0] in _PAR_TYPES \
                and type(body[1]) is list:
            import importlib
            module, _, cls = body[0].rpartition(".")
            fields = {}
            for pair in body[1]:
                if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str:
                    raise ValueError("a malformed object")
                fields[pair[0]] = _decode(pair[1], depth + 1)
            return getattr(importlib.import_module(module), cls)(**fields)
        if tag == "__plan__" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2 or pair[0] not in _PLAN_KEYS \
                        or type(pair[1]) not in (int, bool):
                    raise ValueError("a malformed plan")
                out[pair[0]] = pair[1]
            return {"__plan__": out}
        if tag == "__tensor__" and type(body) is list and len(body) in (3, 4) and body[0] in _DTYPES:
            import torch
            dtype, shape, values = body[:3]
            grad = len(body) == 4 and body[3] is True and dtype.startswith(("float", "bfloat"))
            if type(shape) is not list or not all(type(s) is int and s >= 0 for s in shape):
                raise ValueError("a malformed tensor shape")
            if type(values) is not list or not all(type(v) in (bool, int, float) for v in values):
                raise ValueError("a malformed tensor")
            n = 1
            for s in shape:
                n *= s
            if n != len(values):
                raise ValueError("a tensor whose shape does not match its values")
            return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape).requires_grad_(grad)
    raise ValueError(f"not plain data: {str(y)[:80]}")
'''

KERNEL_HELPER = CODEC + r'''

class __par_grader__:
    """The grader's end of the data channel in this kernel (see par.course.grading.checks): a comm, whose messages call
    the student's functions on the kernel's main thread without IPython's cell machinery (~1 ms a call)."""

    @staticmethod
    def call(name, payload):
        import json
        from IPython import get_ipython
        args, kwargs = _decode(json.loads(payload))
        namespace = get_ipython().user_ns
        if name not in namespace:
            raise NameError(f"name {name!r} is not defined")
        result = namespace[name](*args, **kwargs)
        if _values_left([result, args, kwargs], _MAX_VALUES) < 0:
            raise ValueError(f"your function's answer holds more than {_MAX_VALUES} values: the grader reads "
                             f"{_MAX_VALUES >> 19} MB of data at most")
        answer = {"result": _encode(result), "args": _encode(args), "kwargs": _encode(kwargs)}
        if getattr(result, "requires_grad", False) and type(result).__module__.startswith("torch"):
            __par_grader__.graphs.append((result, __par_grader__.leaves([args, kwargs])))
            answer["graph"] = len(__par_grader__.graphs) - 1     # the grader's backward comes back for it
        return json.dumps(answer)

    graphs = []

    @staticmethod
    def leaves(x):
        import torch
        if isinstance(x, torch.Tensor):
            return [x] if x.requires_grad else []
        if type(x) in (list, tuple):
            return [t for v in x for t in __par_grader__.leaves(v)]
        if type(x) is dict:
            return [t for v in x.values() for t in __par_grader__.leaves(v)]
        return []

    @staticmethod
    def backward(graph, payload):
        import json
        import torch
        result, leaves = __par_grader__.graphs[graph]
        grads = torch.autograd.grad(result, leaves, _decode(json.loads(payload)), allow_unused=True)
        return json.dumps({"result": _encode(list(grads)), "args": [], "kwargs": {"__dict__": []}})

    @staticmethod
    def opened(comm, _):
        @comm.on_msg
        def received(msg):
            data = msg["content"]["data"]
            try:
                if data.get("op") == "backward":
                    comm.send({"data": __par_grader__.backward(int(data["graph"]), data["payload"])})
                else:
                    comm.send({"data": __par_grader__.call(data["name"], data["payload"])})
            except BaseException as e:  # the student's exception (or the grader's interrupt) goes back as data
                comm.send({"error": [type(e).__name__, str(e)[:2000]]})


get_ipython().kernel.comm_manager.register_target("par-grader", __par_grader__.opened)
'''

_codec: dict = {}
exec(CODEC, _codec)  # noqa: S102  (our own source, above)
encode, decode = _codec["_encode"], _codec["_decode"]
