"""Two programs that never import each other: `worker.agent` (torch-free, HTTP) and `worker.training`
(the training process). `worker.checkpoint_layout` is the one module both read."""
