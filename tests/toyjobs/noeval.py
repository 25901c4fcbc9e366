"""The toy job without fl_evaluate_model: its rounds are judged by their aggregated training metrics."""

from tests.toyjobs.toy import fl_init_weights, fl_train_model

__all__ = ["fl_init_weights", "fl_train_model"]
