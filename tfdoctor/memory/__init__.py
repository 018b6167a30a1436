"""Memory estimation for one training step: `analytic` (pure Python, from the shape) and `traced`
(fake tensors, from the user's model). Importing this package does not import torch.
"""
