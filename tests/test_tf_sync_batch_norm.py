"""SyncBatchNormalization as a Keras layer: saved and loaded like any layer (its statistics across
ranks are checked in tests/test_tf_mpi.py::test_horovod_parity)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")


def test_a_model_with_sync_batch_norm_saves_and_loads(tmp_path) -> None:
    import tunelab.tensorflow as hvd

    model = keras.Sequential([keras.Input((4,)), hvd.SyncBatchNormalization(momentum=0.7, epsilon=1e-2,
                                                                             synchronized=True)])
    model.layers[0].moving_mean.assign(np.arange(4, dtype=np.float32))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    layer = loaded.layers[0]
    assert type(layer) is hvd.SyncBatchNormalization
    assert (layer.momentum, layer.epsilon) == (0.7, 1e-2)
    assert layer.moving_mean.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    x = np.ones((2, 4), np.float32)  # inference uses the moving statistics, no collective
    np.testing.assert_allclose(loaded(x, training=False).numpy(), model(x, training=False).numpy())
