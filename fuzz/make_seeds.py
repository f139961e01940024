#!/usr/bin/python3
"""Writes the generated part of the fuzz seed corpora (fuzz/corpus/<target>/):
job specs as SubmitJob sends them, message headers as the transports send them, a
tiny TorchScript model, and data files. The schedule CSVs come from `pippyctl schedule --csv`, the
plans from `pippyctl split --out`, the other models from the test zoo; crash-* files
are inputs that once crashed a target (kept so that they never do again).

    /usr/bin/python3 fuzz/make_seeds.py fuzz/corpus
"""
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python", "pippy", "_stubs"))
from proto import job_pb2  # noqa: E402


def job_specs(out):
    def spec(name, **kw):
        s = job_pb2.JobSpec()
        s.schedule.kind = kw.get("kind", job_pb2.SCHEDULE_1F1B)
        s.schedule.microbatches = kw.get("microbatches", 4)
        s.schedule.stages_per_worker = kw.get("stages_per_worker", 0)
        s.split.stages = kw.get("stages", 2)
        s.split.split_at.extend(kw.get("split_at", []))
        s.steps = kw.get("steps", 3)
        s.batch_size = kw.get("batch_size", 8)
        s.optimizer.kind = kw.get("optimizer", job_pb2.OPTIMIZER_SGD)
        s.optimizer.lr = 0.1
        s.loss = kw.get("loss", job_pb2.LOSS_MSE)
        if "replicas" in kw:
            s.replicas = kw["replicas"]
        with open(os.path.join(out, name + ".pb"), "wb") as f:
            f.write(s.SerializeToString())

    spec("1f1b")
    spec("gpipe", kind=job_pb2.SCHEDULE_GPIPE)
    spec("interleaved", kind=job_pb2.SCHEDULE_INTERLEAVED_1F1B, stages=4, microbatches=4)
    spec("zbv", kind=job_pb2.SCHEDULE_ZBV, stages=4, microbatches=4, optimizer=job_pb2.OPTIMIZER_ADAMW)
    spec("inference", kind=job_pb2.SCHEDULE_INFERENCE, loss=job_pb2.LOSS_UNSPECIFIED)
    spec("split_at", stages=0, split_at=["blocks.1", "blocks.2:end"], kind=job_pb2.SCHEDULE_GPIPE)
    spec("replicas", replicas=2, batch_size=16, optimizer=job_pb2.OPTIMIZER_ADAM)


KINDS = {"none": 0, "tensor": 1, "int": 2, "double": 3, "bool": 4, "tuple": 5, "list": 6, "string": 7}


def header(value, inline=False):
    """The wire format of pipeline/transport/wire_format.h; tensors are (dtype, shape)."""
    out = bytearray(struct.pack("<I", 0x50505949 if inline else 0x50505931))
    payload = bytearray()

    def put(v):
        if v is None:
            out.append(KINDS["none"])
        elif isinstance(v, bool):
            out.extend([KINDS["bool"], int(v)])
        elif isinstance(v, int):
            out.append(KINDS["int"]); out.extend(struct.pack("<q", v))
        elif isinstance(v, float):
            out.append(KINDS["double"]); out.extend(struct.pack("<d", v))
        elif isinstance(v, str):
            b = v.encode(); out.append(KINDS["string"]); out.extend(struct.pack("<I", len(b))); out.extend(b)
        elif isinstance(v, list):
            out.append(KINDS["list"]); out.extend(struct.pack("<I", len(v)))
            for e in v:
                put(e)
        elif isinstance(v, tuple) and len(v) == 3 and v[0] == "T":
            _, dtype, shape = v  # dtype: c10::ScalarType (6 float, 4 long, 11 bool)
            out.extend([KINDS["tensor"], dtype, len(shape)])
            for d in shape:
                out.extend(struct.pack("<q", d))
            n = {6: 4, 4: 8, 11: 1, 7: 8, 5: 2, 15: 2}[dtype]
            for d in shape:
                n *= d
            payload.extend(bytes(n))
        elif isinstance(v, tuple):
            out.append(KINDS["tuple"]); out.extend(struct.pack("<I", len(v)))
            for e in v:
                put(e)
    put(value)
    return bytes(out + (payload if inline else b""))


def wire_headers(out):
    seeds = {
        "tensor": ("T", 6, [4, 8]),
        "tuple": (("T", 6, [2, 3]), ("T", 4, [2]), None),
        "nested": [("T", 11, [3]), (1, 2.5, True, "mask"), []],
        "scalar_tensor": ("T", 7, []),
        "inline_tensor": None,
        "inline_tuple": None,
    }
    for name, v in seeds.items():
        if v is None:
            continue
        with open(os.path.join(out, name + ".bin"), "wb") as f:
            f.write(header(v))
    with open(os.path.join(out, "inline_tensor.bin"), "wb") as f:
        f.write(header(("T", 6, [2, 2]), inline=True))
    with open(os.path.join(out, "inline_tuple.bin"), "wb") as f:
        f.write(header((("T", 5, [3]), 7, ("T", 15, [1, 2])), inline=True))


def tiny_model(out):
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 4)
            self.b = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    torch.jit.script(Tiny()).save(os.path.join(out, "tiny.pt"))


def data_files(out):
    """torch.save data files as SubmitJob receives them, and one whose pickle announces a
    4 GiB string (LibTorch's unpickler makes room for it before reading)."""
    import zipfile
    import torch

    torch.manual_seed(0)
    torch.save({"inputs": torch.randn(8, 4), "targets": torch.randn(8, 2)}, os.path.join(out, "tensor.pt"))
    torch.save({"inputs": (torch.randn(6, 3), torch.ones(6, 3, dtype=torch.bool)), "targets": torch.arange(6)},
               os.path.join(out, "tuple.pt"))
    torch.save({"inputs": {"x": torch.randn(5, 2), "mask": torch.zeros(5, 2)}}, os.path.join(out, "dict.pt"))
    torch.save({"inputs": torch.randn(4, 2), "targets": torch.randn(3, 2)}, os.path.join(out, "row-mismatch.pt"))
    src = zipfile.ZipFile(os.path.join(out, "tensor.pt"))
    with zipfile.ZipFile(os.path.join(out, "oom-pickle-string-length"), "w", zipfile.ZIP_STORED) as evil:
        for n in src.namelist():
            evil.writestr(n, b"\x80\x02X\x00\x00\x00\xf0" + b"a" * 16 if n.endswith("data.pkl") else src.read(n))


def request_files(out):
    """Serving requests as Infer receives them (torch.save of forward()'s arguments), and
    hostile ones: a 4 GiB string, a type tag for LibTorch's type parser, a list that
    holds itself, values nested 100 deep, a global torch.save never writes for tensors,
    a record that claims more bytes than the file."""
    import io
    import zipfile
    import torch

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    good = {"tensor.pt": x, "tuple.pt": (x, torch.arange(3)), "list.pt": [x, x.clone()],
            "dict.pt": {"x": x, "mask": torch.ones(3, 4, dtype=torch.bool)}, "datafile.pt": {"inputs": x},
            "scalars.pt": (x, 3, 2.5, True, None, "text"), "int64.pt": torch.randint(0, 64, (2, 16)),
            "one-item-list.pt": [x], "one-item-dict.pt": {"x": x}}
    for name, v in good.items():
        torch.save(v, os.path.join(out, name))
    cyclic = [torch.zeros(1)]
    cyclic.append(cyclic)
    torch.save(cyclic, os.path.join(out, "cycle-list-holds-itself"))
    deep = torch.zeros(1)
    for _ in range(100):
        deep = [deep]
    torch.save(deep, os.path.join(out, "deep-nesting-100"))
    torch.save((x, x), os.path.join(out, "same-tensor-twice"))

    def with_pickle(name, pkl, base="tensor.pt"):
        src = zipfile.ZipFile(os.path.join(out, base))
        with zipfile.ZipFile(os.path.join(out, name), "w", zipfile.ZIP_STORED) as z:
            for n in src.namelist():
                z.writestr(n, pkl if n.endswith("data.pkl") else src.read(n))

    with_pickle("oom-pickle-string-length", b"\x80\x02X\x00\x00\x00\xf0" + b"a" * 16)
    with_pickle("type-tag", b"\x80\x02ctorch.jit._pickle\nrestore_type_tag\n]X\x09\x00\x00\x00List[int]\x86R.")
    with_pickle("global-os-system", b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00id\x85R.")
    with_pickle("truncated-pickle", open(os.path.join(out, "tensor.pt"), "rb").read()[:0] + b"\x80\x02]q\x00(")
    # A record whose directory entry claims 4 GiB (the bytes are what they were).
    raw = bytearray(open(os.path.join(out, "tensor.pt"), "rb").read())
    i = raw.rfind(b"PK\x01\x02")  # the last central directory entry: sizes at +20 (compressed), +24 (uncompressed)
    raw[i + 24:i + 28] = (0xF0000000).to_bytes(4, "little")
    open(os.path.join(out, "record-claims-4gib"), "wb").write(bytes(raw))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "corpus")
    for d, make in [("job_spec_fuzz", job_specs), ("wire_header_fuzz", wire_headers), ("model_fuzz", tiny_model),
                    ("data_fuzz", data_files), ("request_fuzz", request_files)]:
        path = os.path.join(root, d)
        os.makedirs(path, exist_ok=True)
        make(path)


if __name__ == "__main__":
    main()
