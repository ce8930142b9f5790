"""The model zoo by name: AlexNet, AlexNet-BN, ResNet-50 v1 / v1.5 / v2, and small members
for 28–64 px images (tests, the demo). ``create_model(name)``, ``list_models()``,
``flops(model, input_size)``, ``channels_last_unsafe_layer(model)``."""
from hpcdl.models import alexnet as _alexnet  # noqa: F401  (registers its models)
from hpcdl.models import resnet as _resnet  # noqa: F401
from hpcdl.models.channels_last import channels_last_unsafe_layer
from hpcdl.models.profile import flops
from hpcdl.models.registry import create_model, list_models, register_model

__all__ = ["channels_last_unsafe_layer", "create_model", "list_models", "register_model", "flops"]
