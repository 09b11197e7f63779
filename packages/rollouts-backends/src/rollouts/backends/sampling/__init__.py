"""In-process sampling: the KV-cache sampler, its fast decode step, and the InferenceEngine around it."""
