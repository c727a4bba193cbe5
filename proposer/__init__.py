"""The LLM proposer: rewrite templates, validate the result, keep only what wins.

Everything that comes from the model is untrusted: it is rendered in a Jinja2 sandbox,
statically checked, compiled by nvcc in a subprocess and run only in the GPU worker.
"""
