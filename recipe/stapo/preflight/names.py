"""Names and identity: what the config names exists, and a method's run selects the method's tokens."""

from __future__ import annotations

import difflib
import inspect

from omegaconf import DictConfig

from recipe.stapo.methods import methods
from recipe.stapo.policy_loss import POLICY_LOSS, settings_of

from .problem import ACTOR, Problem, is_int, pick, world_size


def token_selection(config: DictConfig) -> str:
    """The token selection a config runs (``none`` without the recipe's policy-loss config)."""
    policy_loss = pick(config, POLICY_LOSS)
    if policy_loss is None or not str(policy_loss.get("_target_", "")).endswith("TokenSelectionLossConfig"):
        return "none"
    return str(policy_loss.get("token_selection", "none"))


def valid_settings(config: DictConfig):
    """The recipe's policy-loss settings; None without them, or when invalid (:func:`check_names` says why)."""
    try:
        return settings_of(config)
    except ValueError:
        return None


def check_names(config: DictConfig, found: list[Problem]) -> None:
    """Policy loss, token-selection settings, advantage estimator, reward function."""
    # verl loads only after VERL_USE_EXTERNAL_MODULES is set (importing this module imports no verl)
    import verl_patches.activate  # noqa: F401  (the patches every worker runs with)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, AdvantageEstimator

    mode = pick(config, f"{POLICY_LOSS}.loss_mode", "vanilla")
    if mode not in POLICY_LOSS_REGISTRY:
        found.append(Problem(f"{POLICY_LOSS}.loss_mode", "not a registered policy loss",
                             f"use one of {sorted(POLICY_LOSS_REGISTRY)}", mode))
    try:
        settings_of(config)
    except ValueError as e:
        found.append(Problem(POLICY_LOSS, str(e), "use the values docs/method.md lists for these keys"))
    estimator = str(pick(config, "algorithm.adv_estimator", "grpo"))
    known = sorted(set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator})
    if estimator not in known:
        found.append(Problem("algorithm.adv_estimator", "not one of verl's advantage estimators",
                             f"use one of {known}", estimator))
    check_reward_function(config, found)
    check_sequence_parallel(config, found)
    check_random_seed(config, found)


#: S2T's ``random`` strategy seeds rank ``r``'s generator with ``seed * SEED_STRIDE + r``
SEED_STRIDE = 1_000_003
TORCH_SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


def random_seed_range(world: int) -> tuple[int, int]:
    """The seeds whose every rank's generator seed (of ``world`` ranks) torch takes."""
    low, high = TORCH_SEED_RANGE
    return -(-low // SEED_STRIDE), (high - (world - 1)) // SEED_STRIDE


def check_random_seed(config: DictConfig, found: list[Problem]) -> None:
    """With ``strategy=random``, a seed every rank's generator can take (torch's fails in the first update)."""
    cfg = valid_settings(config)
    if cfg is None or cfg.strategy != "random":
        return
    world = world_size(config) or 1
    low, high = random_seed_range(world)
    if not low <= cfg.seed <= high:
        found.append(Problem(f"{POLICY_LOSS}.seed", f"the random strategy seeds each rank's generator with seed x "
                             f"{SEED_STRIDE:,} + rank, which torch's generator takes only within 64 bits: on "
                             f"{world} ranks the seed must lie in [{low}, {high}] (it would fail in the first update, "
                             "after Ray)",
                             f"use a seed in that range, e.g. {POLICY_LOSS}.seed=0", cfg.seed))


def check_sequence_parallel(config: DictConfig, found: list[Problem]) -> None:
    """No Ulysses sequence parallelism with a current-policy forward of the recipe's."""
    sp, cfg = pick(config, f"{ACTOR}.ulysses_sequence_parallel_size", 1), valid_settings(config)
    if not (is_int(sp) and sp > 1) or cfg is None:
        return
    uses = []
    if cfg.selects_tokens and cfg.statistics_source == "current":
        why = "stats_from=current" if cfg.stats_from == "current" else f"scope {cfg.resolved_scope}"
        uses.append(f"{cfg.token_selection} from the current policy ({why})")
    if cfg.monitor_forwards_current_policy:
        uses.append("the S2T monitor with stats_from=current")
    if cfg.measures_update_effect:
        uses.append(f"update_effect_responses={cfg.update_effect_responses}")
    if uses:
        found.append(Problem(
            f"{ACTOR}.ulysses_sequence_parallel_size",
            f"sequence parallelism is not supported with {', '.join(uses)}: the recipe's current-policy forwards "
            "need every rank's full output",
            f"set {ACTOR}.ulysses_sequence_parallel_size=1 (and a token budget that holds the longest sequence), "
            f"or {POLICY_LOSS}.stats_from=rollout (and update_effect_responses=0)", sp))


def check_reward_function(config: DictConfig, found: list[Problem]) -> None:
    """The reward function resolves in its module, as verl's reward loop will load it."""
    key = "reward.custom_reward_function"
    path, name = pick(config, f"{key}.path"), pick(config, f"{key}.name")
    if not path:
        found.append(Problem(f"{key}.path", "is empty: verl would then grade with its own default for each data "
                             "source (for math_dapo, math_dapo.compute_score without JustRL's strict box check), not "
                             "the reward the run is configured for",
                             "set it to pkg://recipe.stapo.reward (the recipe's rewards, docs/reward.md), or name "
                             "verl's default explicitly: path=pkg://verl.utils.reward_score, name=default_compute_score",
                             path))
        return
    from verl.utils.import_utils import load_module  # verl loads only after VERL_USE_EXTERNAL_MODULES is set

    try:
        module = load_module(str(path))
    except Exception as e:  # noqa: BLE001  (anything the import raises is the problem to report)
        found.append(Problem(f"{key}.path", f"cannot be imported ({type(e).__name__}: {e})",
                             "point it to an importable module (pkg://package.module) or an existing .py file", path))
        return
    fn = getattr(module, str(name), None) if name else None
    if callable(fn):
        check_reward_signature(config, fn, found)
        return
    candidates = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
    close = difflib.get_close_matches(str(name), candidates, n=1)
    hint = f"did you mean {key}.name={close[0]}? " if close else ""
    found.append(Problem(f"{key}.name", f"not a function of {path}",
                         f"{hint}functions there: {', '.join(candidates) or 'none'}", name))


#: the keywords verl's reward managers (naive, dapo, limited, gdpo) call the reward function with
REWARD_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
#: the keywords they add when a reward model serves the run (``reward.reward_model.enable``)
REWARD_MODEL_KEYWORDS = ("reward_router_address", "reward_model_tokenizer")


def check_reward_signature(config: DictConfig, fn, found: list[Problem]) -> None:
    """The reward function takes the keywords verl's reward loop calls it with (and ``reward_kwargs``)."""
    key = "reward.custom_reward_function.name"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an object without a signature: nothing to read
        return
    keywords = list(REWARD_KEYWORDS)
    if pick(config, "reward.reward_model.enable", False):
        keywords += REWARD_MODEL_KEYWORDS
    extra = pick(config, "reward.custom_reward_function.reward_kwargs", None) or {}
    keywords += [str(k) for k in extra]
    try:
        signature.bind(**{k: None for k in keywords})
    except TypeError as e:
        found.append(Problem(
            key, f"{fn.__name__}{signature} cannot take the call verl's reward loop makes, "
            f"{fn.__name__}({', '.join(f'{k}=...' for k in keywords)}) ({e}); it would fail at the first reward, "
            "after Ray, the model load and the first rollout",
            "give it those keyword parameters (or **kwargs for the ones it does not use), e.g. "
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)", pick(config, key)))


def check_identity(config: DictConfig, found: list[Problem]) -> None:
    """A method's run selects that method's tokens, or its experiment name says what it runs instead."""
    method = str(pick(config, "recipe.method", ""))
    expected = methods()[method].token_selection if method in methods() else None
    actual = token_selection(config)
    name = str(pick(config, "trainer.experiment_name", ""))
    if expected is None or actual == expected or actual.lower() in name.lower():
        return
    found.append(Problem(
        f"{POLICY_LOSS}.token_selection",
        f"method={method} selects {expected!r}, and the experiment name {name!r} does not say "
        f"otherwise: the run would be filed as {method} without {method}'s token selection",
        f"drop the override, or name the run after what it runs: trainer.experiment_name={name}_{actual} "
        f"(EXPERIMENT in the run scripts)", actual))
