"""Engine-side speculative decoding: the speculation policy and its cost model (the drafters
themselves live with the runner in vllm/v1/worker/gpu/spec_decode/)."""
