"""``hvd.callbacks`` of ``tunelab.tensorflow.keras`` (Horovod's ``horovod.tensorflow.keras.callbacks``)."""

from ..callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]
