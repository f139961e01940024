"""pippy's Python client: submit, follow, fetch and list jobs on a pippy coordinator
over its gRPC API (proto/coordinator.proto), as pippyctl does.

    import pippy
    c = pippy.Client("127.0.0.1:7070")
    job = c.submit("model.pt", "data.pt", stages=2, schedule="1f1b", microbatches=4,
                   batch_size=16, steps=40, loss="mse", optimizer="adamw", lr=1e-3)
    for event in c.watch(job):
        print(event["state"], event["step"], event.get("loss"))
    c.fetch(job, "trained.pt")

    # Serving: the stages stay loaded; requests are batched into micro-batches.
    served = c.serve("model.pt", example="input.pt", stages=2, max_batch=16, max_delay_ms=5, name="m")
    c.wait_serving(served)
    y = c.infer("m", x)                       # x: a tensor (or tuple/dict of them), rows along dim 0
    for request_id, y in c.infer_stream("m", [x1, x2, x3]):   # one stream, answers as they come
        ...

Needs python3-grpcio and python3-protobuf (Debian). The stubs in _stubs/ are made by
client/python/generate from proto/.
"""
import os
import sys

import grpc
from google.protobuf import json_format

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stubs"))
from proto import coordinator_pb2, coordinator_pb2_grpc, job_pb2, options_pb2  # noqa: E402

__all__ = ["Client", "InferError", "JobFailed", "PippyError"]

CHUNK = 1 << 20
_CODES = {c.value[0]: c for c in grpc.StatusCode}

# Job states after which nothing changes (the terminal option in proto/coordinator.proto).
TERMINAL = {v.name for v in coordinator_pb2.JobState.DESCRIPTOR.values
            if v.GetOptions().Extensions[options_pb2.terminal]}


class PippyError(Exception):
    """An RPC the coordinator refused or could not serve; .code is the gRPC status code."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code


class JobFailed(PippyError):
    """wait() on a job that ended FAILED or CANCELLED."""


class InferError(PippyError):
    """One request of infer_stream() that was refused or failed (the stream goes on)."""

    def __init__(self, code, message, request_id):
        super().__init__(code, message)
        self.request_id = request_id


def _to_bytes(inputs):
    """A request's input: bytes as they are, else torch.save of the value."""
    if isinstance(inputs, (bytes, bytearray)):
        return bytes(inputs)
    import io
    import torch
    buf = io.BytesIO()
    torch.save(inputs, buf)
    return buf.getvalue()


def _from_bytes(output, raw):
    if raw:
        return output
    import io
    import torch
    return torch.load(io.BytesIO(output))


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as e:
        raise PippyError(e.code(), e.details()) from None


def _normalized(text):
    return text.lower().replace("-", "").replace("_", "")


def _enum(enum, value, what):
    """The number of the value of `enum` (a job_pb2 enum) that `value` names as pippyctl
    takes it: its cli_name or a cli_alias, ignoring case, '-' and '_' (the options on
    the enum's values in proto/job.proto: the one table pippyctl and the daemons read)."""
    names = []
    wanted = _normalized(str(value))
    # torch.distributed.pipelining's class names too: "Schedule1F1B", "ScheduleGPipe", ...
    candidates = [wanted] + ([wanted[len("schedule"):]] if wanted.startswith("schedule") and wanted != "schedule" else [])
    for v in enum.DESCRIPTOR.values:
        options = v.GetOptions()
        if not options.HasExtension(options_pb2.cli_name):
            continue
        name = options.Extensions[options_pb2.cli_name]
        names.append(name)
        accepted = {_normalized(n) for n in [name, *options.Extensions[options_pb2.cli_alias]]}
        if any(c in accepted for c in candidates):
            return v.number
    raise PippyError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: unknown {value!r}; use {', '.join(names)}")


def _check_arguments(fn, what, given):
    """Refuses keyword arguments `fn` does not take with PippyError naming the nearest
    ones (what a misspelled pippyctl flag gets), instead of Python's TypeError."""
    import difflib
    import inspect
    known = [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]
    for key in given:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise PippyError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{what}: unknown argument {key!r}{hint} (the arguments are pippyctl {what}'s flags: "
                             f"{', '.join(known)})")


def make_spec(model_path, data_path=None, *, stages=0, split_at=(), balance="params", schedule, microbatches,
              batch_size, steps=1, loss=None, optimizer=None, lr=0.01, momentum=0.0, weight_decay=None,
              beta1=None, beta2=None, eps=None, clip_grad_norm=0.0, name=None, seed=0, synthetic="",
              stages_per_worker=0, replicas=1, checkpoint_every=None, max_restarts=None, recovery_timeout_s=None,
              dtype="fp32", lr_schedule=None, warmup_steps=0, min_lr=0.0, dataset=None, seq_len=0,
              token_dtype=None, shuffle=False, epochs=0, resume_from="", eval_dataset=None, eval_every=0,
              eval_batches=0, tensor_parallel=1, tp_plan=""):
    """The JobSpec pippyctl submit would send (the coordinator checks it again).
    dtype: "fp32" or "bf16" (autocast to bfloat16, fp32 weights; pippyctl's --dtype).
    lr_schedule: "constant", "linear" or "cosine", with warmup_steps and min_lr (pippyctl's
    --lr-schedule, --warmup-steps, --min-lr; torch.optim.lr_scheduler's semantics).
    dataset: a folder or manifest of shards the workers read themselves (docs/data.md),
    with seq_len, token_dtype ("uint16", "uint32") and shuffle for token streams; epochs
    instead of steps. resume_from: a job id whose last checkpoint this job starts from
    (steps then count the whole run). eval_dataset: a validation dataset, evaluated after
    every eval_every-th step and the last on its first eval_batches batches; the record's
    "evals" list each evaluation's step and loss. tensor_parallel, tp_plan: every stage
    computed by T ranks, sharded as the plan says ("layers.*.attn.q=colwise,...", styles
    colwise, rowwise, vocab; pippyctl's --tensor-parallel, --tp-plan)."""
    if epochs and steps == 1:
        steps = 0  # epochs give the steps
    spec = job_pb2.JobSpec(name=name or os.path.splitext(os.path.basename(model_path))[0], steps=steps,
                           batch_size=batch_size, seed=seed, replicas=replicas, epochs=epochs,
                           resume_from=resume_from)
    spec.precision = _enum(job_pb2.Precision, dtype, "dtype")
    spec.split.stages = stages
    spec.split.split_at.extend(split_at)
    spec.split.balance = _enum(job_pb2.Balance, balance, "balance")
    _set_tensor_parallel(spec, tensor_parallel, tp_plan)
    spec.schedule.kind = _enum(job_pb2.ScheduleKind, schedule, "schedule")
    spec.schedule.microbatches = microbatches
    spec.schedule.stages_per_worker = stages_per_worker
    if schedule != "inference":
        if loss:
            spec.loss = _enum(job_pb2.LossKind, loss, "loss")
        if optimizer:
            spec.optimizer.kind = _enum(job_pb2.OptimizerKind, optimizer, "optimizer")
        spec.optimizer.lr = lr
        spec.optimizer.momentum = momentum
        spec.optimizer.clip_grad_norm = clip_grad_norm
        if lr_schedule:
            spec.optimizer.lr_schedule = _enum(job_pb2.LrScheduleKind, lr_schedule, "lr_schedule")
        spec.optimizer.warmup_steps = warmup_steps
        spec.optimizer.min_lr = min_lr
        for field, value in (("weight_decay", weight_decay), ("beta1", beta1), ("beta2", beta2), ("eps", eps)):
            if value is not None:
                setattr(spec.optimizer, field, value)
    if data_path:
        spec.data.file = os.path.basename(data_path)
    spec.data.synthetic = synthetic
    if dataset:
        # Absolute, as this client sees it: the daemons read it where they run (a shared mount).
        spec.data.dataset.path = os.path.abspath(dataset)
        spec.data.dataset.seq_len = seq_len
        spec.data.dataset.shuffle = bool(shuffle)
        if token_dtype:
            spec.data.dataset.token_dtype = _enum(job_pb2.TokenDtype, token_dtype, "token_dtype")
    if eval_dataset:
        spec.eval.dataset.path = os.path.abspath(eval_dataset)
        spec.eval.every = eval_every
        spec.eval.batches = eval_batches
    for field, value in (("checkpoint_every", checkpoint_every), ("max_restarts", max_restarts),
                         ("recovery_timeout_s", recovery_timeout_s)):
        if value is not None:
            setattr(spec.fault_tolerance, field, value)
    return spec


def _set_tensor_parallel(spec, size, plan):
    """--tensor-parallel T --tp-plan "PATTERN=STYLE,..." (the coordinator checks the plan)."""
    if size <= 1 and not plan:
        return
    spec.tensor_parallel.size = size
    styles = {"colwise": job_pb2.TP_COLWISE, "rowwise": job_pb2.TP_ROWWISE, "vocab": job_pb2.TP_VOCAB}
    for entry in filter(None, (e.strip() for e in plan.split(","))):
        pattern, sep, style = entry.partition("=")
        if not sep or style.strip() not in styles:
            raise PippyError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"tp_plan: {entry!r} is not PATTERN=STYLE with STYLE colwise, rowwise or vocab")
        spec.tensor_parallel.rules.add(pattern=pattern.strip(), style=styles[style.strip()])


def make_serving_spec(model_path, example=None, *, stages=0, split_at=(), balance="params", max_batch=0,
                      max_delay_ms=None, max_inflight=0, name=None, synthetic="", seed=0, dtype="fp32",
                      tensor_parallel=1, tp_plan="", max_queued=0, generate=False, max_slots=0, max_seq=0,
                      prefill_chunk=0):
    """The JobSpec pippyctl serve would send (generate=True: pippyctl serve --generate)."""
    spec = job_pb2.JobSpec(name=name or os.path.splitext(os.path.basename(model_path))[0], seed=seed)
    spec.precision = _enum(job_pb2.Precision, dtype, "dtype")
    spec.split.stages = stages
    spec.split.split_at.extend(split_at)
    spec.split.balance = _enum(job_pb2.Balance, balance, "balance")
    _set_tensor_parallel(spec, tensor_parallel, tp_plan)
    spec.serving.max_batch = max_batch
    if max_delay_ms is not None:
        spec.serving.max_delay_ms = max_delay_ms
    spec.serving.max_inflight = max_inflight
    spec.serving.max_queued = max_queued
    if generate:
        spec.serving.generation.max_slots = max_slots
        spec.serving.generation.max_seq = max_seq
        spec.serving.generation.prefill_chunk = prefill_chunk
    elif max_slots or max_seq or prefill_chunk:
        raise PippyError(grpc.StatusCode.INVALID_ARGUMENT,
                         "max_slots, max_seq and prefill_chunk are a generation job's: add generate=True")
    if example:
        spec.data.file = os.path.basename(example)
    spec.data.synthetic = synthetic
    return spec


class _Generation:
    """Client.generate's iterator over one sequence's tokens."""

    def __init__(self, call):
        self._call = call
        self._tokens = []
        self.finish_reason = None
        self.seed = None
        self.ttft_ms = None

    def __iter__(self):
        return self

    def __next__(self):
        while not self._tokens:
            if self.finish_reason is not None:
                raise StopIteration
            try:
                r = next(self._call)
            except StopIteration:
                raise PippyError(grpc.StatusCode.UNAVAILABLE, "the stream ended before the sequence did") from None
            except grpc.RpcError as e:
                raise PippyError(e.code(), e.details()) from None
            if self.seed is None:
                self.seed = r.seed
            if r.ttft_ms:
                self.ttft_ms = r.ttft_ms
            self._tokens.extend(r.tokens)
            if r.done:
                self.finish_reason = r.finish_reason
        return self._tokens.pop(0)

    def close(self):
        """Ends the sequence (its slot is freed)."""
        self._call.cancel()


class Client:
    """A connection to a coordinator at "HOST:PORT" (default: $PIPPY_COORDINATOR or
    localhost:7070). token: the user's token for a coordinator with --auth-token-file
    (default: $PIPPY_TOKEN); tls_ca: the PEM file of the CA that signed its certificate
    when it serves TLS (default: $PIPPY_TLS_CA)."""

    def __init__(self, coordinator=None, timeout_s=30.0, token=None, tls_ca=None):
        self.coordinator = coordinator or os.environ.get("PIPPY_COORDINATOR", "localhost:7070")
        self.timeout_s = timeout_s
        token = token if token is not None else os.environ.get("PIPPY_TOKEN", "")
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        tls_ca = tls_ca if tls_ca is not None else os.environ.get("PIPPY_TLS_CA", "")
        options = [("grpc.max_receive_message_length", 64 << 20)]
        if tls_ca:
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.secure_channel(self.coordinator, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(self.coordinator, options=options)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _submit_spec(self, job_spec, model_path, data_path, detach=False):
        """SubmitJob: the spec, then the model and the data file (if any) in chunks."""

        def requests():
            yield coordinator_pb2.SubmitJobRequest(spec=job_spec, detach=detach)
            for path, field in ((model_path, "model_chunk"), (data_path, "data_chunk")):
                if not path:
                    continue
                with open(path, "rb") as f:
                    while True:
                        chunk = f.read(CHUNK)
                        if not chunk:
                            break
                        yield coordinator_pb2.SubmitJobRequest(**{field: chunk})

        resp = _call(self._stub.SubmitJob, requests(), metadata=self._metadata)
        import warnings
        for notice in resp.notices:  # accepted, but probably not meant
            warnings.warn(f"pippy: {notice}", stacklevel=3)
        return resp.job_id

    def submit(self, model_path, data_path=None, detach=False, **spec):
        """Uploads the model (and data) in chunks; returns the job id. Keyword arguments
        are pippyctl submit's flags (stages=, schedule=, microbatches=, batch_size=, ...).
        detach=True (pippyctl submit --detach): returns once the upload is stored; the
        job is PARTITIONING while the coordinator prepares it, and a refusal shows as
        FAILED with its reason (status(), watch()) instead of raising here."""
        _check_arguments(make_spec, "submit", spec)
        missing = [k for k in ("schedule", "microbatches", "batch_size") if k not in spec]
        if missing:
            raise PippyError(grpc.StatusCode.INVALID_ARGUMENT, f"submit: give {', '.join(missing)}")
        job_spec = make_spec(model_path, data_path, **spec)
        return self._submit_spec(job_spec, model_path, data_path, detach)

    def serve(self, model_path, example=None, **options):
        """Starts a serving job (pippyctl serve): the model split into stages that stay
        loaded until cancel(). example: a file with an example input (a request's input
        or a data file), or synthetic="inputs=float32[8,1024]". Keyword arguments are
        pippyctl serve's flags (make_serving_spec's). Returns the job id."""
        _check_arguments(make_serving_spec, "serve", options)
        return self._submit_spec(make_serving_spec(model_path, example, **options), model_path, example)

    def wait_serving(self, job_id, timeout_s=600.0):
        """Waits until a serving job answers requests; raises JobFailed if it ended first."""
        import time
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.status(job_id)
            if job["state"] == "SERVING":
                return job
            if job["state"] in TERMINAL:
                raise JobFailed(grpc.StatusCode.ABORTED, f"job {job_id} {job['state']}: {job.get('reason', '')}")
            if time.monotonic() > deadline:
                raise PippyError(grpc.StatusCode.DEADLINE_EXCEEDED, f"job {job_id} is still {job['state']}")
            time.sleep(0.2)

    def infer(self, job, inputs, timeout_s=None, raw=False):
        """One request to a serving job (its id or name). inputs: forward()'s arguments
        (a tensor, tuple or dict of tensors, rows along dim 0) or torch.save'd bytes.
        Returns the request's rows of forward()'s output (bytes with raw=True)."""
        r = _call(self._stub.Infer, coordinator_pb2.InferRequest(job=job, input=_to_bytes(inputs)),
                  timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        return _from_bytes(r.output, raw)

    def infer_stream(self, job, inputs, timeout_s=None, raw=False):
        """Many requests over one stream; yields (index, output) as answers come (not in
        order), or (index, InferError) for a request that failed."""
        items = list(inputs)

        def requests():
            for i, x in enumerate(items):
                yield coordinator_pb2.InferRequest(job=job, input=_to_bytes(x), request_id=str(i))

        try:
            for r in self._stub.InferStream(requests(), timeout=timeout_s, metadata=self._metadata):
                i = int(r.request_id)
                if r.code != 0:
                    yield i, InferError(_CODES.get(r.code, grpc.StatusCode.UNKNOWN), r.error, i)
                else:
                    yield i, _from_bytes(r.output, raw)
        except grpc.RpcError as e:
            raise PippyError(e.code(), e.details()) from None

    def generate(self, job, prompt, max_new_tokens=16, temperature=0.0, top_k=0, top_p=0.0, seed=None,
                 stop_tokens=(), timeout_s=None):
        """Generates from a prompt with a generation job (pippyctl serve --generate):
        an iterator over the token ids as they are sampled (greedy unless temperature >
        0). prompt: a list of token ids or a 1-D integer tensor. Closing the iterator
        (or its deadline passing) ends the sequence and frees its slot. After the last
        token, the iterator's `finish_reason` ("length", "stop", "max_seq") and `seed`
        are set."""
        req = coordinator_pb2.GenerateRequest(job=job, max_new_tokens=max_new_tokens, temperature=temperature,
                                              top_k=top_k, top_p=top_p, stop_tokens=list(stop_tokens))
        if seed is not None:
            req.seed = seed
        if hasattr(prompt, "tolist"):
            prompt = prompt.tolist()
        req.tokens.extend(int(t) for t in prompt)
        return _Generation(self._stub.Generate(req, timeout=timeout_s, metadata=self._metadata))

    def status(self, job_id):
        """The job record as a dict (protobuf JSON with the .proto's field names)."""
        job = _call(self._stub.GetJob, coordinator_pb2.GetJobRequest(job_id=job_id), timeout=self.timeout_s,
                    metadata=self._metadata)
        return json_format.MessageToDict(job, preserving_proto_field_name=True)

    def list_jobs(self, states=(), user="", limit=0, newest_first=False):
        """Job summaries (dicts; no plan or loss array: status() has them), oldest first
        (newest first with newest_first), only those in `states` (names such as
        "RUNNING") and of `user` when given, at most `limit` (0: all), page by page."""
        req = coordinator_pb2.ListJobsRequest(
            states=[coordinator_pb2.JobState.Value(s.upper()) for s in states], user=user,
            order_by="create_time desc" if newest_first else "")
        jobs = []
        while True:
            req.page_size = min(limit - len(jobs), 1000) if limit else 1000
            r = _call(self._stub.ListJobs, req, timeout=self.timeout_s, metadata=self._metadata)
            jobs += [json_format.MessageToDict(j, preserving_proto_field_name=True) for j in r.jobs]
            if not r.next_page_token or (limit and len(jobs) >= limit):
                return jobs
            req.page_token = r.next_page_token

    def delete(self, job_id):
        """Deletes an ended job: its record, files and trained model."""
        _call(self._stub.DeleteJob, coordinator_pb2.DeleteJobRequest(job_id=job_id), timeout=self.timeout_s,
              metadata=self._metadata)

    def workers(self):
        r = _call(self._stub.ListWorkers, coordinator_pb2.ListWorkersRequest(), timeout=self.timeout_s,
                  metadata=self._metadata)
        return [json_format.MessageToDict(w, preserving_proto_field_name=True) for w in r.workers]

    def watch(self, job_id):
        """Yields progress events (dicts: state, step, steps, loss, samples_per_second,
        message, lr, and eval_loss with eval_step once a job evaluated) until the job ends,
        each change once; loss is None before the first step."""
        stream = self._stub.WatchJob(coordinator_pb2.WatchJobRequest(job_id=job_id), metadata=self._metadata)
        last = None
        try:
            for event in stream:
                e = json_format.MessageToDict(event, preserving_proto_field_name=True,
                                              including_default_value_fields=True)
                if e["step"] == 0:
                    e["loss"] = None  # no step yet: no loss (not 0.0)
                # The coordinator may say the same thing twice (a state seen again on
                # reconnection); each change is yielded once.
                key = (e["state"], e["step"], e["message"])
                if key == last:
                    continue
                last = key
                yield e
                if e["state"] in TERMINAL:
                    return
        except grpc.RpcError as e:
            raise PippyError(e.code(), e.details()) from None

    def wait(self, job_id):
        """Follows the job to its end; returns its record, or raises JobFailed."""
        for _ in self.watch(job_id):
            pass
        job = self.status(job_id)
        if job["state"] != "SUCCEEDED":
            raise JobFailed(grpc.StatusCode.ABORTED, f"job {job_id} {job['state']}: {job.get('reason', '')}")
        return job

    def cancel(self, job_id):
        job = _call(self._stub.CancelJob, coordinator_pb2.CancelJobRequest(job_id=job_id), timeout=self.timeout_s,
                    metadata=self._metadata)
        return json_format.MessageToDict(job, preserving_proto_field_name=True)

    def fetch(self, job_id, path, checkpoint=False):
        """Writes the job's result (the trained TorchScript model, or an inference job's
        outputs) to path, streaming; returns the bytes written. checkpoint=True: the
        job's last checkpoint instead, as one TorchScript model (pippyctl fetch --checkpoint)."""
        tmp = path + ".part"
        n = 0
        try:
            with open(tmp, "wb") as f:
                request = coordinator_pb2.FetchModelRequest(job_id=job_id, checkpoint=checkpoint)
                for chunk in self._stub.FetchModel(request, metadata=self._metadata):
                    f.write(chunk.data)
                    n += len(chunk.data)
        except grpc.RpcError as e:
            os.unlink(tmp)
            raise PippyError(e.code(), e.details()) from None
        os.replace(tmp, path)
        return n
