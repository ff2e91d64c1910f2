"""Pre-quantized checkpoints (jaxpage.config.weight_quantization): each format's reader turns its tensors into one form
(tensors.QuantizedTensor), and one layer (dense.QuantizedDense) multiplies by it inside the jitted step."""
