"""The training-time spurious-token dump, actor side: which tokens S2T silences (or would silence), in
context, with the policy's alternatives, for any method (docs/inspect.md).

It is configured by ``recipe.token_dump.*`` (:mod:`.settings`, environment variables in every Ray worker),
scores a few sampled responses per step (:mod:`.scoring`, plain PyTorch) where the actor's hook calls it
(:mod:`.hook`), and writes the record format of :mod:`stapo_core.token_records`, which the inspector and
the plots read.
"""
