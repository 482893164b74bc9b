"""The arithmetic per layer: one Backend per output format and method (backend.py picks it).

    backend.py          the Backend protocol, make_backend, unknown_architecture
    quantize.py         LayerQuantizer: data-free compressed-tensors through llm-compressor, by the model class
    name_only.py        NameOnlyQuantizer: data-free compressed-tensors by tensor names (model_free_ptq's rules)
    calibrate.py        Calibrator: GPTQ / AWQ layer by layer through the model's forward (hessians.py,
                        boundary.py: the activations crossing to the next layer, samples.py: the calibration ids)
    torchao_backend.py  TorchaoBackend: torchao's quantize_ on each layer
    evaluate.py         Evaluator (`verify --quality`): one decoder layer of the source and of the export side by side
    naming.py, quant_error.py, group.py   decoder-layer names, the recorded quantization error, a group's ranks

Never reads the pipe or writes the journal; reads tensors only through child.sources, and writes no shard itself
(child/writer.py does; a calibrated backend writes its boundary files, boundary.py).
"""
