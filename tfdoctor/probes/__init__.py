"""Reusable measurements that several checks share. These modules import torch; none imports recording/.

What a model's outputs depend on:
- `dependency.py`: the dependency map D[i, j], does output i change when input token j changes;
- `cross_attention.py`: which encoder positions each decoder position reads;
- `backbone.py`: a pooled classifier's per-position states, the view the mask checks read;
- `attention.py`: the softmax weights, fused kernels and constants of one forward, seen from inside;
- `perturb.py`: a model's zero-initialised paths opened, for what its architecture can do.

Batches arranged differently:
- `padding.py`: padded batches, and what the model does with the pad positions;
- `pooled.py`: padding seen through a pooled prediction (class scores, regression values);
- `invariance.py`: the same sequences alone, padded among others, or packed in one row.

Decoding:
- `decoding.py`: cached decoding, one token at a time, against one full forward;
- `generation.py`: a Hugging Face model decoded exactly as its generate() does, tokens chosen in advance;
- `own_decoder.py`: decoding with the model's own generate(), as the user's sampling script calls it;
- `greedy.py`: greedy decoding of a memorised batch from each row's first token.

Training, numbers and precision:
- `loss.py`: the loss each kind of model is trained on, on random batches;
- `memorise.py`: a private copy trained on one batch, and the loss its measured context allows;
- `fused_head.py`: token weights from a fused LM head's per-token log-probabilities;
- `depth.py`: the signal through the stack of blocks at initialisation (scale and gradient norm);
- `nonfinite.py`: where the first NaN or Inf appears, the op and the module, forward or backward;
- `precision.py`: the precision a model computes in, and how far rounding alone moves its logits;
- `autocast.py`: one forward per reduced-precision autocast dtype, with the constants it holds;
- `stochastic.py`: whether the forward is random, in eval() and in train();
- `ties.py`: torch.topk with its ties broken by position, to tell a top-k tie order from a padding effect.

Attention implementations:
- `implementations.py`: a measurement run under each attention implementation a model supports;
- `configured_implementation.py`: a model judged by the implementation it runs, the others as warnings.

Leaving the user's model as it was:
- `isolation.py`: the copy the loop trains, and the user's model put back as it went in;
- `process_state.py`: dropout, batch norm, RNGs and threads put back after a probe.
"""
