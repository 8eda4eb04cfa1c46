"""``SyncBatchNormalization``: Keras batch normalization whose training statistics cover every rank's batch.

In training, the mean and variance of each channel are those of all ranks' batches taken together
(two differentiable Sum allreduces: the sums with the counts, then the squared deviations from the
global mean, so a rank's batch may have its own size), so outputs, gradients and moving statistics
equal ``keras.layers.BatchNormalization`` applied to the global batch in one process.  A Keras mask
(sequences) weighs the values as Keras' own batch norm does.  In inference it uses the moving
statistics, like any batch norm.  Every rank must call it at the same points (it is a collective).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ..reduce_ops import Sum
from .ops import auto_name, grouped_allreduce


@keras.saving.register_keras_serializable(package="tunelab")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Drop-in for ``keras.layers.BatchNormalization`` (same arguments) with statistics over all ranks.
    ``synchronized`` (Keras' own, for its distribution strategies) is not used: this layer always is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("synchronized", None)
        super().__init__(*args, **kwargs)

    def _moments(self, inputs: tf.Tensor, mask: Any) -> tuple[tf.Tensor, tf.Tensor]:
        axes = list(self._reduction_axes)
        x = tf.convert_to_tensor(inputs)  # Keras has cast half precision to float32 already
        kept = tf.shape(tf.reduce_sum(x, axes))  # the channels' shape, as Keras' moments return it
        if mask is None:
            weights = None
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)[None]
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1), tf.shape(x)), x.dtype)
            count = tf.reshape(tf.reduce_sum(weights, axes), [-1])[:1]  # the same for every channel
        local = tf.reduce_sum(x if weights is None else x * weights, axes, keepdims=True)
        sums, counts = grouped_allreduce([tf.reshape(local, [-1]), count], op=Sum,
                                         name=auto_name(f"tf.syncbn.{self.name}.sum"))
        # Keras divides a masked sum by its weight plus epsilon (a fully masked batch gives 0, not NaN)
        n = counts[0] + (keras.backend.epsilon() if weights is not None else 0.0)
        mean = tf.reshape(sums / n, tf.shape(local))
        centered = x - mean
        sq = centered * centered if weights is None else centered * centered * weights
        (total,) = grouped_allreduce([tf.reshape(tf.reduce_sum(sq, axes), [-1])], op=Sum,
                                     name=auto_name(f"tf.syncbn.{self.name}.var"))
        return tf.reshape(mean, kept), tf.reshape(total / n, kept)
