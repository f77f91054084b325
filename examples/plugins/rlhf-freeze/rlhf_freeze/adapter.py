from dataclasses import dataclass, field

from rlhf.plugins.models.hf import HFModelAdapter, HFModelConfig


@dataclass(kw_only=True)
class FreezeConfig(HFModelConfig):
    train_last_layers: int = field(default=1, metadata={"help": "Transformer layers that keep training, from the top"})


class FreezeAdapter(HFModelAdapter):
    """The hf adapter with every policy weight frozen except the last N layers and the output head."""

    def load(self, ref, *, role):
        model = super().load(ref, role=role)
        if role == "policy":
            layers = model.get_decoder().layers
            trained = [*layers[len(layers) - self.config.train_last_layers:], model.get_output_embeddings()]
            keep = {id(p) for module in trained for p in module.parameters()}
            for param in model.parameters():
                param.requires_grad_(id(param) in keep)
        return model
