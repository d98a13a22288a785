"""The contracts every room shares: configs, step messages, error types and text, model-file metadata.

app, engine, gpu, kernels and loadtest may all import this package; it imports none of them
(tests/test_layering.py holds that), and nothing in it imports torch, so the HTTP layer and the
scheduler read configs and model metadata without loading a model.
"""
