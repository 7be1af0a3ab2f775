"""An HF-transformers rollout for verl 0.9.1 (``actor_rollout_ref.rollout.name=hf``), for CPU runs.

verl 0.9.x has only server rollouts (vLLM, SGLang, TensorRT-LLM), none of which runs without a GPU.
This module supplies the three pieces verl's rollout machinery expects, in its own registries:

- :class:`HFRolloutServer`: the server, a Ray actor (one per replica) holding a copy of the policy
  as a ``transformers`` causal LM. ``generate`` is verl's token-in/token-out call: it returns a
  ``TokenOutput(token_ids, log_probs, stop_reason, extra_fields)``. Concurrent requests are
  batched (a short collection window) and sampled by :func:`verl_patches.cpu.sampling.sample_batch`;
  control calls (sleep, wake_up, cache and profiling calls) are no-ops: there is no KV cache pool
  to free on CPU. With ``actor_rollout_ref.rollout.full_determinism=true`` (see
  :meth:`HFRolloutServer._request_seed` and :meth:`HFRolloutServer._sample`) every request is
  seeded by verl's per-sample request id and sampled in a forward of its own, so its tokens and
  log-probs do not depend on which requests arrived together (machine load, timing).
- :class:`HFReplica`: the ``RolloutReplica`` (``RolloutReplicaRegistry["hf"]``) that launches the
  server. Only the hybrid mode (rollout colocated with the trainer, verl's default) is supported.
- :class:`HFServerAdapter`: the ``BaseRollout`` living in the trainer worker
  (``_ROLLOUT_REGISTRY[("hf", "async")]``). verl's ``update_weights`` hands it the trainer's
  full weights each step; it copies them to host memory and loads them into the server, so the
  rollout samples from exactly the policy the trainer holds (rollout and trainer log-probs agree to
  float32 noise).

Nothing is registered at import: :func:`register` does it, applied through the recipe's patch
table (:mod:`verl_patches.install`) when the CPU path is selected.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Generator, Optional

import torch

from .ordering import request_seed

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"
ADAPTER_FQDN = "verl_patches.cpu.hf_rollout.HFServerAdapter"
#: seconds the server waits for more requests before sampling a batch
BATCH_WINDOW_S = 0.01


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """Ray actor name of a replica's server (the adapter finds it by this name)."""
    return f"{ROLLOUT_NAME}_server_{replica_rank}_{node_rank}"


def _model_path(model_config: Any) -> str:
    for key in ("local_path", "path"):
        value = getattr(model_config, key, None) if not isinstance(model_config, dict) else model_config.get(key)
        if value:
            return str(value)
    raise ValueError("HF rollout: actor_rollout_ref.model.path is not set")


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    key: tuple  # (temperature, top_p, top_k): requests sharing it are sampled in one batch
    seed: int  # this request's own draws (see HFRolloutServer._request_seed)
    future: asyncio.Future = field(repr=False)


def sampling_key(sampling_params: dict) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) from verl's sampling params; temperature <= 0 means greedy,
    sampled as top_k = 1 at temperature 1 (log-probs are then those of the untempered policy)."""
    temperature = float(sampling_params.get("temperature", 1.0))
    top_p = float(sampling_params.get("top_p", 1.0))
    top_k = int(sampling_params.get("top_k", -1) or -1)
    if temperature <= 0:
        return 1.0, 1.0, 1
    return temperature, top_p, top_k


class HFRolloutServer:
    """Ray actor: a ``transformers`` copy of the policy that samples for verl's agent loop.

    Args (as verl passes them to every rollout server): ``config`` (RolloutConfig), ``model_config``
    (the ``actor_rollout_ref.model`` config), ``replica_rank``. Extra keyword arguments are ignored.
    """

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, **_: Any) -> None:
        # transformers and verl's config helpers load in the rollout server's process only
        from transformers import AutoModelForCausalLM, GenerationConfig

        # verl's config helpers: in the rollout server's process only
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)
        self.replica_rank = replica_rank
        self.global_steps: Optional[int] = None
        path = _model_path(model_config)
        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
        self.model.eval()
        eos = GenerationConfig.from_pretrained(path).eos_token_id if os.path.exists(
            os.path.join(path, "generation_config.json")) else self.model.config.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not self.eos_token_ids:
            raise ValueError(f"HF rollout: the model at {path} declares no eos_token_id")
        pad = self.model.config.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        self.seed = int(getattr(self.config, "seed", 0) or 0) + replica_rank
        #: rollout.full_determinism: seed by verl's per-sample request id, one forward per request
        self.deterministic = bool(getattr(self.config, "full_determinism", False))
        self._arrivals: dict[tuple, int] = {}  # (step, prompt) -> requests seen, for _request_seed
        self._queue: list[_Request] = []
        self._worker: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()
        self.batches = 0

    # -- token-in / token-out ---------------------------------------------------------------------
    def _max_tokens(self, prompt_len: int, sampling_params: dict) -> int:
        """Same rule as verl's vLLM server: response_length, capped by the prompt+response budget."""
        budget = self.config.prompt_length + self.config.response_length - prompt_len
        wanted = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        max_tokens = min(self.config.response_length, budget) if wanted is None else int(wanted)
        return max(1, min(max_tokens, budget))

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **_: Any):
        """Sample one response for ``prompt_ids``; returns verl's ``TokenOutput``."""
        if image_data is not None or video_data is not None:
            raise ValueError("HF rollout: multimodal inputs are not supported")
        loop = asyncio.get_running_loop()
        ids = list(map(int, prompt_ids))
        request = _Request(ids, self._max_tokens(len(ids), sampling_params), sampling_key(sampling_params),
                           self._request_seed(ids, request_id), loop.create_future())
        self._queue.append(request)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await request.future

    def _request_seed(self, prompt_ids: list[int], request_id: Optional[str] = None) -> int:
        """Seed of one request, a sha256 digest of (server seed, step, prompt, which sample).

        Which sample: with ``rollout.full_determinism`` verl's agent loop sends a stable request id
        per sample (``det-<priority>``: the sample's index in the step's batch with the legacy
        trainer, in its group with the v1 trainer, see :mod:`verl_patches.cpu.ordering`), used as
        is; a run then
        gives every sample the same draws whatever the order in which requests arrive. Otherwise
        (verl sends a random id) it is the k-th request of that prompt in the step, in arrival
        order: the n samples of a prompt draw the same n streams, but which batch row gets which
        stream follows the arrival order, so the training batch (and its float reductions) is
        only the same up to a permutation inside each group.
        """
        key = (self.global_steps, tuple(prompt_ids))
        if self.deterministic and request_id is not None:
            which: Any = str(request_id)
        else:
            which = self._arrivals.get(key, 0)
            self._arrivals = {kk: v for kk, v in self._arrivals.items() if kk[0] == self.global_steps}
            self._arrivals[key] = which + 1
        return request_seed(self.seed, self.global_steps, key[1], which)

    async def _drain(self) -> None:
        """Sample queued requests batch by batch until the queue is empty."""
        while self._queue:
            await asyncio.sleep(BATCH_WINDOW_S)
            key = self._queue[0].key
            batch = [r for r in self._queue if r.key == key]
            self._queue = [r for r in self._queue if r.key != key]
            try:
                async with self._lock:
                    outputs = await asyncio.to_thread(self._sample, batch)
            except Exception as exc:  # hand the error to every waiting request
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, out in zip(batch, outputs):
                if not r.future.done():
                    r.future.set_result(out)

    def _sample(self, batch: list[_Request]):
        """Sample every request of ``batch`` (one sampling key). Batched in one forward, or, when
        ``self.deterministic``, one forward per request: a batched forward's float results (and so
        the log-probs and, rarely, a drawn token) can depend on the batch's size and padding,
        which depend on which requests happened to arrive within one collection window."""
        # the sampler and verl's rollout types load in the rollout server's process only
        from verl_patches.cpu.sampling import sample_batch
        from verl.workers.rollout.replica import TokenOutput

        temperature, top_p, top_k = batch[0].key
        groups = [[r] for r in batch] if self.deterministic else [batch]
        samples = []
        for group in groups:
            samples += sample_batch(self.model, [r.prompt_ids for r in group],
                                    max_new_tokens=max(r.max_tokens for r in group),
                                    eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                                    temperature=temperature, top_p=top_p, top_k=top_k,
                                    generator=[torch.Generator().manual_seed(r.seed) for r in group])
            self.batches += 1
        outputs = []
        for r, s in zip(batch, samples):
            ids, logps = s.token_ids[: r.max_tokens], s.log_probs[: r.max_tokens]
            outputs.append(TokenOutput(token_ids=ids, log_probs=logps, stop_reason="completed",
                                       extra_fields={"global_steps": self.global_steps}))
        return outputs

    # -- weights ----------------------------------------------------------------------------------
    async def update_weights(self, state_dict: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> int:
        """Load the trainer's weights (HF parameter names, full tensors). Returns tensors loaded.

        Raises ValueError naming the keys when a name is unknown or a parameter is left unset
        (tied embeddings excepted)."""
        async with self._lock:
            own = self.model.state_dict()
            unknown = sorted(set(state_dict) - set(own))
            if unknown:
                raise ValueError(f"HF rollout update_weights: unknown parameter names {unknown[:5]}")
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            missing = sorted(set(own) - set(state_dict) - tied)
            if missing:
                raise ValueError(f"HF rollout update_weights: parameters not sent {missing[:5]}")
            with torch.no_grad():
                for name, tensor in state_dict.items():
                    own[name].copy_(tensor.to(own[name].dtype))
            if global_steps is not None:
                self.global_steps = global_steps
        return len(state_dict)

    async def get_weight(self, name: str) -> torch.Tensor:
        """A copy of one parameter (for tests)."""
        return self.model.state_dict()[name].detach().clone()

    # -- control calls verl makes on every rollout server (no KV cache pool on CPU) -----------------
    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self._queue or (self._worker is not None and not self._worker.done()):
            await asyncio.sleep(BATCH_WINDOW_S)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def _replica_class() -> type:
    # verl's rollout modules load when verl builds the replica, not inside `import verl` (patch registration)
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica

    class HFReplica(RolloutReplica):
        """One HF rollout server per replica (hybrid mode: colocated with the trainer workers)."""

        async def launch_servers(self) -> None:
            # ray: in the replica's process, when it launches its server
            import ray

            if self.rollout_mode != RolloutMode.HYBRID:
                raise NotImplementedError(f"HF rollout supports only the hybrid rollout mode, got {self.rollout_mode}")
            if self.world_size != 1:
                raise ValueError("HF rollout: set actor_rollout_ref.rollout.tensor_model_parallel_size=1 "
                                 f"(and data/pipeline parallel 1); got a rollout world size of {self.world_size}")
            name = server_actor_name(self.replica_rank)
            server = ray.remote(HFRolloutServer).options(name=name, num_cpus=0, max_concurrency=self.max_concurrency,
                                                         ).remote(config=self.config, model_config=self.model_config,
                                                                  replica_rank=self.replica_rank)
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"{ROLLOUT_NAME}://{name}"

    return HFReplica


def load_replica_class() -> type:
    """Loader registered in ``RolloutReplicaRegistry`` (returns the same class every call)."""
    global _REPLICA_CLASS
    if _REPLICA_CLASS is None:
        _REPLICA_CLASS = _replica_class()
    return _REPLICA_CLASS


_REPLICA_CLASS: Optional[type] = None


def _adapter_class() -> type:
    # verl's rollout modules load when verl builds the adapter, not inside `import verl` (patch registration)
    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """Trainer-side handle of the HF rollout server: pushes the trainer's weights to it."""

        def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", "0"))
            self.replica_rank = rank if replica_rank == -1 else replica_rank
            self._has_server = True
            self.server_handle = None

        def _server(self):
            # ray: in the adapter's process, when it looks up its server
            import ray

            if self.server_handle is None:
                self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
            return self.server_handle

        async def resume(self, tags: list[str]) -> None:
            return None

        async def release(self) -> None:
            return None

        @torch.no_grad()
        async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                                 wire_format: str = "named_tensors", global_steps: Optional[int] = None,
                                 peft_config: Any = None, **kwargs: Any) -> None:
            """Copy the trainer's full weights to host memory and load them into the server."""
            if wire_format != "named_tensors":
                raise NotImplementedError(f"HF rollout: wire_format={wire_format!r} is not supported "
                                          "(use checkpoint_engine.backend=naive)")
            if peft_config is not None:
                raise NotImplementedError("HF rollout: LoRA adapters are not supported (use model.lora.merge=True)")
            start = time.time()
            state = {name: t.detach().to("cpu", copy=True) for name, t in weights}
            await self._server().update_weights.remote(state, global_steps)
            logger.info("HF rollout: %d tensors synced in %.2fs", len(state), time.time() - start)

        def generate_sequences(self, prompts: Any) -> Any:
            raise NotImplementedError("HF rollout runs in server mode through verl's agent loop")

    HFServerAdapter.__module__ = __name__
    HFServerAdapter.__qualname__ = "HFServerAdapter"
    return HFServerAdapter


def __getattr__(name: str) -> Any:
    # verl's get_rollout_class resolves ADAPTER_FQDN with getattr(module, "HFServerAdapter").
    if name == "HFServerAdapter":
        cls = _adapter_class()
        globals()["HFServerAdapter"] = cls
        return cls
    if name == "HFReplica":
        return load_replica_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the HF rollout in verl's two rollout registries (idempotent)."""
    # verl's rollout registries load when the patch is applied, not when the patch table is read
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_FQDN
    RolloutReplicaRegistry.register(ROLLOUT_NAME, load_replica_class)


def is_registered() -> bool:
    """True when both of verl's rollout registries hold the HF rollout."""
    # verl's rollout registries load when the patch is applied, not when the patch table is read
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return (_ROLLOUT_REGISTRY.get((ROLLOUT_NAME, "async")) == ADAPTER_FQDN
            and RolloutReplicaRegistry._registry.get(ROLLOUT_NAME) is load_replica_class)
