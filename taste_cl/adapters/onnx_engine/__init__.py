"""The ONNX engine: training graphs in standard ONNX that run on plain, current ``onnxruntime``.

- :mod:`.export`: :func:`export_engine`, the forward, backward and optimizer graphs of a torch model;
- :mod:`.capture`: torch's own forward/backward partition (AOT autograd), cut to what the engine passes;
- :mod:`.decompositions`: convolution and pooling gradients in ops ONNX Runtime runs as GEMMs;
- :mod:`.optimizers`: SGD and AdamW steps as ONNX graphs;
- :mod:`.engine`: :class:`OnnxEngine`, the runtime side (numpy and onnxruntime only, no torch);
- :mod:`.adapt_export`: :func:`export_adapter`, BN-adapt or TENT as a folder that ``learner.load_adapter`` runs torch-free.

Import from the modules (``from taste_cl.adapters.onnx_engine.engine import OnnxEngine``): this package
imports nothing, so the torch-free runtime side never loads the export side.
"""
