"""The GPU report's parts (`bench.gpu_report`): device (mfu, decode, profile) and serving."""
