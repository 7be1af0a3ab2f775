"""The training-time spurious-token dump, actor side: which tokens S2T silences (or would silence), in
context, with the policy's alternatives, for any method (docs/inspect.md): its settings
(:mod:`.settings`), scoring (:mod:`.scoring`) and the actor's hook (:mod:`.hook`).
"""
