"""Weight sync, actor -> engines. It sits above both: it uses the actor and the engine clients, neither imports it.

    reload.py   engine.sync=reload: safetensors every engine reloads in place; `paused`, both paths' pause protocol
    nccl.py     engine.sync=nccl: actor rank 0 broadcasts straight to every engine worker
"""
