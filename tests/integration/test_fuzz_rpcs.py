"""Fuzz every RPC of both services with raw, mutated request bytes against real servers.

A coordinator and one worker run in-process on port 0 (in a background event loop, so the
hypothesis tests drive them with a plain blocking channel). Every method listed in the
generated descriptors is called with serialized requests built from valid seeds, mutated at
field and byte level (``tests/fuzz_strategies.py``), bypassing the client library's checks.
Each answer must be a clean status (``CLEAN``): UNKNOWN or INTERNAL mean an exception escaped
a servicer, or grpc.aio failed to parse the request (``shared.rpc.interceptors`` turns that
into INVALID_ARGUMENT). After each method both servers must still answer a health check and
a valid request, and the memories loaded before must read back unchanged.

RPCs that legitimately change state when a mutated message happens to be valid are made
safe by choosing inputs (``_make_safe``), or skipped (``SKIPPED``), each with the reason.
Methods added to the protos later are fuzzed too, from an empty seed message.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from coordinator.coordinator_servicer import CoordinatorServicer
from coordinator.server import CoordinatorServer
from shared.config import ConfigError, CoordinatorConfig, WorkerConfig, job_spec_from_json
from shared.memory.slots import slot_of
from shared.proto import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from shared.rpc.codec import rows_to_bytes, tensors_to_chunks
from tests.fuzz_strategies import fuzz, message_bytes
from worker.server import WorkerServer
from worker.worker_servicer import WorkerServicer

pytestmark = pytest.mark.integration

S = 16  # slots: small, so fuzzed slot numbers land in range often
REPO = Path(__file__).resolve().parents[2]
SC = grpc.StatusCode
CLEAN = {
    SC.OK,
    SC.INVALID_ARGUMENT,
    SC.FAILED_PRECONDITION,
    SC.NOT_FOUND,
    SC.OUT_OF_RANGE,
    SC.RESOURCE_EXHAUSTED,
    SC.PERMISSION_DENIED,
    SC.UNAUTHENTICATED,
    SC.ALREADY_EXISTS,
    SC.ABORTED,  # Replicate's documented answer to a forward out of sequence (OutOfSync)
}
LEFT_OPEN = {"/neuroshard.v1.Coordinator/WatchJob"}  # follows a QUEUED job until its deadline
SKIPPED = {
    # Copies slots to the named target and forwards every later write of them there; its
    # input is the coordinator's own plan. Its slot list is checked by the store's as_slots,
    # fuzzed in tests/unit/worker/store/test_fuzz_decoders.py; an unreachable target is
    # test_copy_to_an_unreachable_worker_is_unavailable.
    "/neuroshard.v1.Worker/CopySlots",
}
# Examples per method: the other methods get DEFAULT_EXAMPLES.
DEFAULT_EXAMPLES = 50
EXAMPLES = {
    "/neuroshard.v1.Coordinator/SubmitJob": 120,  # the spec parser and admission
    "/neuroshard.v1.Worker/Upsert": 100,
    "/neuroshard.v1.Worker/Replicate": 100,
    "/neuroshard.v1.Worker/ApplySlotMap": 100,
    "/neuroshard.v1.Worker/ReceiveSlots": 80,
    "/neuroshard.v1.Worker/ComputeGradients": 80,
    "/neuroshard.v1.Worker/StartTraining": 30,  # a valid one builds a model: slower
    "/neuroshard.v1.Coordinator/PutDataset": 100,  # the upload's .npz decoding
}

SERVICES = [
    (coordinator_pb2, "Coordinator", CoordinatorServicer, coordinator_pb2_grpc.CoordinatorServicer),
    (worker_pb2, "Worker", WorkerServicer, worker_pb2_grpc.WorkerServicer),
]


@dataclass(frozen=True)
class Method:
    """One RPC as the descriptors describe it."""

    path: str
    name: str
    request: type[Message]
    client_streaming: bool
    server_streaming: bool
    implemented: bool


def all_methods() -> list[Method]:
    out = []
    for module, service, impl, base in SERVICES:
        desc = module.DESCRIPTOR.services_by_name[service]
        for m in desc.methods:
            out.append(
                Method(
                    f"/{desc.full_name}/{m.name}",
                    m.name,
                    GetMessageClass(m.input_type),
                    m.client_streaming,
                    m.server_streaming,
                    getattr(impl, m.name) is not getattr(base, m.name),
                )
            )
    return out


METHODS = [m for m in all_methods() if m.path not in SKIPPED]

# --- the cluster ---------------------------------------------------------------------------

WORKER = "w0"
JOB_ID = "fuzz-train"
# Memories loaded before the fuzz and read back after each method (ids far from the ones
# the seeds write, so no mutation of a seed reaches them by chance).
rng = np.random.default_rng(2024)
KEPT_IDS = rng.integers(1 << 62, 1 << 63, size=12, dtype=np.uint64)
KEPT_STRENGTHS = rng.random(12, dtype=np.float32)
KEPT_PAYLOADS = [bytes([i]) * (i + 1) for i in range(12)]
SEED_IDS = np.array([1, 2, 3, 1000, 2**33 + 7], np.uint64)  # what the write seeds carry
STEP_ROWS = rows_to_bytes(np.arange(8))  # the rows ComputeGradients' seeds name
TINY_TRAIN = {
    "kind": "train",
    "name": "fuzz",
    "workers": 1,
    "model": {"name": "mlp", "hidden": [4]},
    "data": "digits",
    "optimizer": {"name": "sgd", "lr": 0.1},
    "steps": 1,
    "batch_size": 8,
}


class Cluster:
    """A coordinator and one worker served by an event loop in a background thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers")
        self.coordinator: CoordinatorServer | None = None
        self.worker: WorkerServer | None = None
        self.channels: dict[str, grpc.Channel] = {}
        self.epoch = 0
        self.slot_map = common_pb2.SlotMap()
        self.queued_job = self.finished_job = ""

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> None:
        self.thread.start()
        self.run(self._start())
        for name, server in (("coordinator", self.coordinator), ("worker", self.worker)):
            assert server is not None
            self.channels[name] = grpc.insecure_channel(server.address)
        self._wait_for_map()
        self._load()

    async def _start(self) -> None:
        self.coordinator = CoordinatorServer(
            CoordinatorConfig(
                listen="127.0.0.1:0",
                data_dir=str(self.root / "coord"),
                metrics_port=None,
                grace_s=0.2,
                slots=S,
                queue_timeout_s=600,
                max_jobs_per_client=40,
            )
        )
        address = await self.coordinator.start()
        self.worker = WorkerServer(
            WorkerConfig(
                coordinator=address,
                listen="127.0.0.1:0",
                name=WORKER,
                data_dir=str(self.root / WORKER),
                metrics_port=None,
                grace_s=0.2,
            )
        )
        await self.worker.start()

    def stop(self) -> None:
        for ch in self.channels.values():
            ch.close()

        async def stop() -> None:
            if self.worker is not None:
                await self.worker.stop()
            if self.coordinator is not None:
                await self.coordinator.stop()

        try:
            self.run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            self.loop.close()

    @property
    def coordinator_stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(self.channels["coordinator"])

    @property
    def worker_stub(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channels["worker"])

    def _wait_for_map(self) -> None:
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = self.coordinator_stub.GetSlotMap(coordinator_pb2.GetSlotMapRequest(), timeout=5)
            if m.epoch and all(p == 0 for p in m.primary):
                try:
                    self.worker_stub.Get(worker_pb2.GetRequest(epoch=m.epoch), timeout=5)
                    self.epoch, self.slot_map = m.epoch, m
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise AssertionError("the worker never got a slot map")

    def _load(self) -> None:
        reply = self.worker_stub.Upsert(
            worker_pb2.UpsertRequest(
                epoch=self.epoch,
                ids=KEPT_IDS.astype("<u8").tobytes(),
                strengths=KEPT_STRENGTHS.astype("<f4").tobytes(),
                payloads=KEPT_PAYLOADS,
                request_id=b"load",
            ),
            timeout=10,
        )
        assert reply.applied == len(KEPT_IDS)
        spec = json.dumps({**TINY_TRAIN, "workers": 1000})
        submit = self.coordinator_stub.SubmitJob
        self.finished_job = submit(coordinator_pb2.SubmitJobRequest(spec_json=spec)).job_id
        self.coordinator_stub.CancelJob(coordinator_pb2.JobRequest(job_id=self.finished_job))
        self.queued_job = submit(coordinator_pb2.SubmitJobRequest(spec_json=spec)).job_id
        self.worker_stub.StartTraining(
            worker_pb2.StartTrainingRequest(
                job_id=JOB_ID, spec_json=json.dumps(TINY_TRAIN), shard_index=0, shard_count=1
            ),
            timeout=60,
        )

    def kept(self) -> tuple[bytes, bytes, list[bytes]]:
        """The loaded memories as the worker returns them now."""
        r = self.worker_stub.Get(
            worker_pb2.GetRequest(
                epoch=self.epoch, ids=KEPT_IDS.astype("<u8").tobytes(), with_payloads=True
            ),
            timeout=10,
        )
        return r.found, r.strengths, list(r.payloads)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("fuzz-rpcs"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


# --- seeds: valid-looking requests of each method -------------------------------------------


def _trainers(cluster: Cluster) -> Any:
    """The job ids the worker has a trainer for (the fuzzed StartTraining adds some)."""
    assert cluster.worker is not None
    return cluster.worker.sessions._trainers


def _params(cluster: Cluster) -> list[tuple[str, np.ndarray]]:
    assert cluster.worker is not None
    trainer = cluster.worker.sessions.get(JOB_ID)
    return [(n, p.detach().numpy().copy()) for n, p in trainer.model.named_parameters()]


def seeds(method: Method, c: Cluster) -> list[Any]:
    """Valid requests of ``method`` (a list of messages per call for client streams)."""
    e, ids = c.epoch, SEED_IDS.astype("<u8").tobytes()
    strengths = np.full(len(SEED_IDS), 0.5, "<f4").tobytes()
    upsert = worker_pb2.UpsertRequest(
        epoch=e, ids=ids, strengths=strengths, payloads=[b"x"] * len(SEED_IDS), request_id=b"u"
    )
    slots = sorted(set(slot_of(SEED_IDS, S).tolist()))
    specs = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "configs/jobs").glob("*.yaml"))]
    table: dict[str, list[Any]] = {
        "RegisterWorker": [
            coordinator_pb2.RegisterWorkerRequest(name="w9", address="", device="cpu")
        ],
        "Heartbeat": [coordinator_pb2.HeartbeatRequest(name="w9", memories=3, slot_map_epoch=e)],
        "GetSlotMap": [coordinator_pb2.GetSlotMapRequest()],
        "ReportFailure": [
            coordinator_pb2.ReportFailureRequest(reporter="w9", worker="w8", reason="r", slots=[1])
        ],
        "DrainWorker": [coordinator_pb2.DrainWorkerRequest(name="w9")],
        "SubmitJob": [
            coordinator_pb2.SubmitJobRequest(spec_json=json.dumps({**s, "workers": 1000}))
            for s in [*specs, TINY_TRAIN]
        ],
        "GetJob": [coordinator_pb2.JobRequest(job_id=c.finished_job)],
        "CancelJob": [coordinator_pb2.JobRequest(job_id=c.finished_job)],
        "RunEpochs": [coordinator_pb2.RunEpochsRequest(job_id=c.finished_job, epochs=1)],
        "FinishJob": [coordinator_pb2.JobRequest(job_id=c.finished_job)],
        "WatchJob": [
            coordinator_pb2.JobRequest(job_id=c.finished_job),
            coordinator_pb2.JobRequest(job_id=c.queued_job),
        ],
        "GetModel": [
            coordinator_pb2.GetModelRequest(job_id=c.finished_job),
            coordinator_pb2.GetModelRequest(job_id=c.finished_job, best=True),
        ],
        "ListModels": [coordinator_pb2.ListModelsRequest()],
        "Decay": [coordinator_pb2.DecayRequest(rate=0.0), worker_pb2.WorkerDecayRequest(epoch=e)],
        "TopK": [coordinator_pb2.TopKRequest(k=5), worker_pb2.WorkerTopKRequest(epoch=e, k=5)],
        "Quality": [worker_pb2.WorkerQualityRequest(epoch=e)],
        "StartTraining": [
            worker_pb2.StartTrainingRequest(
                job_id="fuzz-other", spec_json=json.dumps(TINY_TRAIN), shard_index=0, shard_count=1
            )
        ],
        "StopTraining": [worker_pb2.StopTrainingRequest(job_id="fuzz-other")],
        "Upsert": [upsert],
        "Get": [worker_pb2.GetRequest(epoch=e, ids=ids, with_payloads=True)],
        "Delete": [worker_pb2.DeleteRequest(epoch=e, ids=ids, request_id=b"d")],
        "Reinforce": [
            worker_pb2.ReinforceRequest(epoch=e, ids=ids, boosts=strengths, request_id=b"r")
        ],
        "Replicate": [
            worker_pb2.ReplicateRequest(
                primary="w9", epoch=e, slots=slots, seqs=[99] * len(slots), upsert=upsert
            ),
            worker_pb2.ReplicateRequest(
                primary="w9", epoch=e, slots=[0], seqs=[1], decay=worker_pb2.WorkerDecayRequest()
            ),
        ],
        "ApplySlotMap": [c.slot_map],
        "DumpSlots": [worker_pb2.DumpSlotsRequest(slots=slots[:2])],
        "SlotSeqs": [worker_pb2.SlotSeqsRequest(slots=slots)],
    }
    if method.name == "ReceiveSlots":
        s = slots[0]
        mine = SEED_IDS[slot_of(SEED_IDS, S) == s]
        msg = worker_pb2.SlotData(
            slot=s,
            seq=1,
            ids=mine.astype("<u8").tobytes(),
            strengths=np.full(len(mine), 0.5, "<f4").tobytes(),
            payload_ids=mine.tolist()[:1],
            payloads=[b"p"],
            first=True,
        )
        return [[msg, msg]]
    if method.name == "ComputeGradients":
        header = worker_pb2.GradientRequest(
            header=worker_pb2.StepHeader(
                job_id=JOB_ID,
                step=0,
                params_version=7,
                params_included=True,
                shard_count=1,
                explicit_rows=True,
                rows=STEP_ROWS,
            )
        )
        chunks = [worker_pb2.GradientRequest(param=ch) for ch in tensors_to_chunks(_params(c), 256)]
        return [[header, *chunks], [header]]
    if method.name == "RunAllreduce":
        spec = json.dumps({**TINY_TRAIN, "strategy": "allreduce"})
        secret = "ab" * 32  # a well-formed rendezvous_secret
        head = worker_pb2.AllreduceHeader(
            job_id="fuzz-other", spec_json=spec, world_size=1, rendezvous_secret=secret
        )
        with_state = worker_pb2.AllreduceHeader(
            job_id="fuzz-other",
            spec_json=spec,
            world_size=2,
            rank=1,
            state_follows=True,
            rendezvous_secret=secret,
        )
        return [
            [worker_pb2.AllreduceInput(header=head)],
            [worker_pb2.AllreduceInput(header=head), worker_pb2.AllreduceInput(rendezvous="")],
            [
                worker_pb2.AllreduceInput(header=with_state),
                worker_pb2.AllreduceInput(state=b"\x80\x02"),
                worker_pb2.AllreduceInput(state_done=True),
            ],
        ]
    if method.name == "PutDataset":
        import io

        uploads = []
        for save in (np.savez, np.savez_compressed):
            buf = io.BytesIO()
            save(buf, x=np.zeros((4, 2), np.float32), y=np.arange(4, dtype=np.int64) % 2)
            data = buf.getvalue()
            header = coordinator_pb2.DatasetChunk(
                header=coordinator_pb2.DatasetHeader(name="fuzz", total_bytes=len(data))
            )
            uploads.append([header, coordinator_pb2.DatasetChunk(data=data)])
        return uploads
    if method.name == "FetchShard":
        return [
            coordinator_pb2.FetchShardRequest(
                job_id=c.queued_job, shard_index=0, shard_count=1, worker=WORKER
            )
        ]
    wanted = [s for s in table.get(method.name, []) if isinstance(s, method.request)]
    return wanted or [method.request()]


# --- making valid mutations harmless ---------------------------------------------------------


def _parse(cls: type[Message], raw: bytes) -> Message | None:
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None  # refused before any servicer code runs


def _make_safe(method: Method, raw: bytes, c: Cluster) -> bytes | None:
    """``raw``, or a changed request where the fuzzed one would legitimately change state
    the test checks; None: do not send it."""
    msg = _parse(method.request, raw)
    if msg is None:
        return raw
    name = method.name
    if name == "RegisterWorker":
        msg.address = ""  # a new worker would take slots: refused after decoding instead
    elif name in ("Heartbeat", "DrainWorker") and msg.name == WORKER:
        msg.name = "w9"  # the real worker's state is not the fuzzer's to change
    elif name == "ReportFailure":
        msg.reporter = "w9" if msg.reporter == WORKER else msg.reporter
        msg.worker = "w8" if msg.worker == WORKER else msg.worker
    elif name == "SubmitJob":
        msg.spec_json = _queued_only(msg.spec_json)
    elif name == "StartTraining":
        if msg.job_id == JOB_ID:
            msg.job_id = "fuzz-other"
        if _valid_spec(msg.spec_json):  # keep training tiny
            msg.spec_json = json.dumps(TINY_TRAIN)
    elif name == "RunAllreduce" and msg.HasField("header"):
        if _valid_spec(msg.header.spec_json):  # no training process is started: refused
            msg.header.spec_json = json.dumps(
                {"kind": "train", "strategy": "allreduce", "steps": 0}
            )
    elif name == "StopTraining" and msg.job_id == JOB_ID:
        msg.job_id = "fuzz-other"
    elif name == "Decay":
        if _valid_rate(msg.rate):
            msg.rate = 0.0  # a no-op decay still runs every step (fan-out, seqs, replicas)
    elif name == "Sweep":
        if _valid_rate(msg.rate):
            msg.rate = 0.0  # statistics and top-k only (a decay's path is Decay's)
    elif name in ("Upsert", "Delete", "Reinforce"):
        if np.isin(np.frombuffer(msg.ids[: len(msg.ids) // 8 * 8], "<u8"), KEPT_IDS).any():
            return None  # would write a loaded memory: legitimate, but not this test's to do
    elif name == "Replicate" and msg.WhichOneof("op") == "decay":
        if _valid_rate(msg.decay.rate):
            msg.decay.rate = 0.0
    elif name == "ApplySlotMap":
        msg.epoch = min(msg.epoch, c.epoch)  # a newer map would be adopted: decoded only
        if msg.max_payload_bytes:  # applied even from an old map (see the report)
            msg.max_payload_bytes = c.slot_map.max_payload_bytes
    return msg.SerializeToString()


def _valid_rate(rate: float) -> bool:
    return bool(np.isfinite(rate)) and 0 <= rate <= 1


def _valid_spec(text: str) -> bool:
    try:
        job_spec_from_json(text)
    except ConfigError:
        return False
    return True


def _queued_only(text: str) -> str:
    """A spec that would be admitted waits for more workers than the cluster has, so no
    fuzzed job runs (it would load memories into the store this test checks)."""
    if not _valid_spec(text):
        return text
    doc = json.loads(text)
    doc["workers"] = 1000
    return json.dumps(doc)


# --- calling ---------------------------------------------------------------------------------


def call(c: Cluster, method: Method, request: bytes | list[bytes]) -> grpc.StatusCode:
    """Send raw request bytes (a list for a client stream); return the final status."""
    service = "coordinator" if "Coordinator" in method.path else "worker"
    ch = c.channels[service]
    open_ended = method.path in LEFT_OPEN
    timeout = 0.5 if open_ended else 30.0
    try:
        if method.client_streaming:
            requests = iter(request if isinstance(request, list) else [request])
            if method.server_streaming:
                for _ in ch.stream_stream(method.path)(requests, timeout=timeout):
                    pass
            else:
                ch.stream_unary(method.path)(requests, timeout=timeout)
        elif method.server_streaming:
            for _ in ch.unary_stream(method.path)(request, timeout=timeout):
                pass
        else:
            ch.unary_unary(method.path)(request, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code()
    return SC.OK


def allowed(method: Method) -> set[grpc.StatusCode]:
    codes = set(CLEAN)
    if method.path in LEFT_OPEN:
        codes.add(SC.DEADLINE_EXCEEDED)
    if not method.implemented:  # a method in the protos that no servicer serves yet
        codes.add(SC.UNIMPLEMENTED)
    return codes


def requests_for(method: Method, c: Cluster) -> st.SearchStrategy[Any]:
    """Raw request bytes (lists of them for client streams) built from the seeds."""
    base = seeds(method, c)
    if not method.client_streaming:
        return message_bytes(*base)
    messages = [m for stream in base for m in stream]
    one = message_bytes(*messages)
    streams = st.sampled_from(base).flatmap(
        lambda s: st.tuples(
            *(st.one_of(st.just(m.SerializeToString()), message_bytes(m)) for m in s)
        ).map(list)
    )
    return st.one_of(streams, st.lists(one, min_size=0, max_size=4))


@dataclass
class Tally:
    codes: dict[str, int] = field(default_factory=dict)

    def add(self, code: grpc.StatusCode) -> None:
        self.codes[code.name] = self.codes.get(code.name, 0) + 1


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.path.rsplit(".", 1)[-1])
def test_fuzzed_requests_get_clean_statuses_and_change_nothing(
    cluster: Cluster, method: Method
) -> None:
    before = cluster.kept()
    codes = allowed(method)
    tally = Tally()
    safe: Callable[[bytes], bytes | None] = lambda raw: _make_safe(method, raw, cluster)  # noqa: E731

    @fuzz(EXAMPLES.get(method.path, DEFAULT_EXAMPLES))
    @given(request=requests_for(method, cluster))
    def fuzz_method(request: Any) -> None:
        if isinstance(request, list):
            request = [r for r in map(safe, request) if r is not None]
            if method.name == "ReceiveSlots":
                # A slot past the last one, last: the stream is decoded and checked message
                # by message, then refused whole (an installed copy would replace a slot).
                bad = worker_pb2.SlotData(slot=S, first=True).SerializeToString()
                request = [*request, bad]
        else:
            request = safe(request)
            if request is None:
                return
        code = call(cluster, method, request)
        tally.add(code)
        assert code in codes, f"{method.path} answered {code.name} to {request!r:.300}"

    fuzz_method()
    assert_still_serving(cluster)
    assert cluster.kept() == before, f"{method.path}: the loaded memories changed"


def assert_still_serving(c: Cluster) -> None:
    for ch in c.channels.values():
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    status = c.coordinator_stub.GetClusterStatus(coordinator_pb2.GetClusterStatusRequest())
    assert [w.state for w in status.workers] == [common_pb2.WORKER_STATE_ALIVE]
    assert status.slot_map_epoch == c.epoch
    found, _, _ = c.kept()
    assert found == b"\x01" * len(KEPT_IDS)


def test_undecodable_bytes_are_invalid_argument_on_both_services(cluster: Cluster) -> None:
    for path in ("/neuroshard.v1.Coordinator/GetJob", "/neuroshard.v1.Worker/Get"):
        service = "coordinator" if "Coordinator" in path else "worker"
        with pytest.raises(grpc.RpcError) as info:
            cluster.channels[service].unary_unary(path)(b"\x0a\x05ab", timeout=10)
        assert info.value.code() is SC.INVALID_ARGUMENT
        assert "Error parsing message" in info.value.details()


def test_every_method_is_fuzzed_or_skipped_with_a_reason() -> None:
    names = {m.path for m in all_methods()}
    assert SKIPPED <= names, "a skipped method no longer exists"
    assert {m.path for m in METHODS} | SKIPPED == names


def test_compute_gradients_with_parameters_of_another_model_is_invalid_argument(
    cluster: Cluster,
) -> None:
    header = worker_pb2.GradientRequest(
        header=worker_pb2.StepHeader(
            job_id=JOB_ID,
            params_version=7,
            params_included=True,
            explicit_rows=True,
            rows=STEP_ROWS,
        )
    )
    method = next(m for m in METHODS if m.name == "ComputeGradients")
    code = call(cluster, method, [header.SerializeToString()])  # no parameters at all
    assert code is SC.INVALID_ARGUMENT


def test_compute_gradients_with_a_non_finite_loss_scale_is_invalid_argument(
    cluster: Cluster,
) -> None:
    header = worker_pb2.GradientRequest(
        header=worker_pb2.StepHeader(
            job_id=JOB_ID,
            params_version=7,
            loss_scale=float("nan"),
            explicit_rows=True,
            rows=STEP_ROWS,
        )
    )
    method = next(m for m in METHODS if m.name == "ComputeGradients")
    code = call(cluster, method, [header.SerializeToString()])
    assert code is SC.INVALID_ARGUMENT


def test_compute_gradients_without_explicit_rows_is_invalid_argument(cluster: Cluster) -> None:
    # The worker does not choose a step's rows: the coordinator always names them.
    header = worker_pb2.GradientRequest(
        header=worker_pb2.StepHeader(job_id=JOB_ID, params_version=7, epoch=0, step_in_epoch=0)
    )
    method = next(m for m in METHODS if m.name == "ComputeGradients")
    request = header.SerializeToString()

    with pytest.raises(grpc.RpcError) as info:
        for _ in cluster.channels["worker"].stream_stream(method.path)(iter([request]), timeout=10):
            pass

    assert info.value.code() is SC.INVALID_ARGUMENT
    assert info.value.details().startswith("explicit_rows: must be true")


def test_report_failure_of_a_slot_out_of_range_is_invalid_argument(cluster: Cluster) -> None:
    request = coordinator_pb2.ReportFailureRequest(reporter="w9", worker="w8", slots=[1, S])
    with pytest.raises(grpc.RpcError) as info:
        cluster.coordinator_stub.ReportFailure(request, timeout=10)
    assert info.value.code() is SC.INVALID_ARGUMENT
    assert f"slots[1]: {S} is outside [0, {S})" in info.value.details()


def _regressions(c: Cluster) -> list[tuple[str, Message, str]]:
    """(method, request, expected message part) of the bugs the fuzzer found, literally."""
    e, one = c.epoch, np.array([5], "<u8").tobytes()
    good_map = c.slot_map
    short_map = common_pb2.SlotMap()
    short_map.CopyFrom(good_map)
    short_map.epoch, short_map.primary[:] = e + 1, [0] * (S - 1)
    other_count = common_pb2.SlotMap(slots=S * 2)  # as a registration reply carries it
    return [
        ("Upsert", worker_pb2.UpsertRequest(epoch=e, ids=one, strengths=b""), "differ in length"),
        (
            "Upsert",
            worker_pb2.UpsertRequest(epoch=e, ids=one, strengths=b"\0" * 4, payloads=[b"a", b"b"]),
            "payloads",
        ),
        (
            "Reinforce",
            worker_pb2.ReinforceRequest(epoch=e, ids=one * 2, boosts=b"\0" * 4),
            "boosts",
        ),
        (
            "ReceiveSlots",
            worker_pb2.SlotData(slot=1, payload_ids=[5]),
            "payloads for 1 payload_ids",
        ),
        ("DumpSlots", worker_pb2.DumpSlotsRequest(slots=[S]), f"slots[0]: {S} is outside"),
        ("Replicate", worker_pb2.ReplicateRequest(epoch=e, slots=[S], seqs=[1]), "is outside"),
        ("Replicate", worker_pb2.ReplicateRequest(epoch=e, slots=[1], seqs=[]), "one seq per slot"),
        ("Replicate", worker_pb2.ReplicateRequest(epoch=e, slots=[1], seqs=[1]), "op None"),
        ("ApplySlotMap", short_map, f"primary: {S - 1} entries for {S} slots"),
        ("ApplySlotMap", other_count, f"holds {S} slots"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_fuzzer_findings_are_refused_cleanly(cluster: Cluster, case: int) -> None:
    name, request, message = _regressions(cluster)[case]
    method = next(m for m in METHODS if m.name == name and isinstance(request, m.request))
    before = cluster.kept()
    raw = request.SerializeToString()
    service = cluster.channels["worker"]
    with pytest.raises(grpc.RpcError) as info:
        if method.client_streaming:
            service.stream_unary(method.path)(iter([raw]), timeout=10)
        elif method.server_streaming:
            list(service.unary_stream(method.path)(raw, timeout=10))
        else:
            service.unary_unary(method.path)(raw, timeout=10)
    expected = SC.FAILED_PRECONDITION if name == "ApplySlotMap" and "holds" in message else None
    assert info.value.code() in ({expected} if expected else {SC.INVALID_ARGUMENT, SC.ABORTED})
    assert message in info.value.details()
    assert_still_serving(cluster)  # a refused map is not adopted: the epoch is unchanged
    assert cluster.kept() == before


async def test_copy_to_an_unreachable_worker_is_unavailable(make_cluster) -> None:
    """CopySlots (skipped by the fuzz, which must not start copies) once answered UNKNOWN
    when its target could not be reached: the peer's AioRpcError escaped the servicer."""
    from shared.rpc import channel

    cluster = await make_cluster(workers=1, slots=S)
    await cluster.wait_alive(1)
    worker = cluster.workers[0]
    epoch = cluster.coordinator.cluster.rebalancer.current.epoch
    request = worker_pb2.CopySlotsRequest(
        epoch=epoch, slots=[0], target="gone", target_address="127.0.0.1:1"
    )
    async with channel(worker.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await worker_pb2_grpc.WorkerStub(ch).CopySlots(request, timeout=20)
    assert info.value.code() is SC.UNAVAILABLE
    assert "copying slots to gone" in (info.value.details() or "")
