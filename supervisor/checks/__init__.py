"""A job checked before anything is written: the source checkpoint, its adapter, the calibration data, a torchao
table. Each check reads, and raises the InputError (supervisor.errors) that names the fix.

    api.prepare ─▶ source.inspect (safetensors headers, config.json, the decoder layers)
               ─▶ adapter.inspect_adapter (a [source] adapter folder: PEFT LoRA only, mergeable)
               ─▶ calibration.check (the dataset, the sample count, the arithmetic a resumed export must match)
               ─▶ torchao_job.check (a torchao scheme and its keywords)

Never writes a file, never starts a process, never imports torch (torchao_job imports torchao, and with it torch,
only for a torchao job).
"""
