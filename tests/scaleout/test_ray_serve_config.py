"""The Ray Serve app's construction and config file, without a cluster (skipped where ``nxdserve[ray]`` is not
installed; CI's default install leaves Ray out)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

serve_schema = pytest.importorskip("ray.serve.schema")

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve-config.yaml"


def test_config_file_is_a_valid_serve_config_that_builds() -> None:
    from nxdserve.deploy.ray_serve import build_app

    config = serve_schema.ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app_config,) = config.applications
    assert app_config.import_path == "nxdserve.deploy.ray_serve:build_app"
    app = build_app(app_config.args)
    engine = app._bound_deployment.init_args[0]._bound_deployment  # the ingress is bound to the engines
    deployment_config = engine._deployment_config
    autoscaling = deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 4, 8)
    router = deployment_config.request_router_config.request_router_class
    assert router.endswith(".PrefixCacheAffinityRouter")
    assert engine.ray_actor_options["num_cpus"] == 1


def test_build_app_types_and_checks_its_arguments() -> None:
    from nxdserve.deploy.ray_serve import build_app

    app = build_app({"max_num_seqs": "4", "num_replicas": "2", "neuron_cores": "2", "enable_prefix_caching": "true"})
    engine = app._bound_deployment.init_args[0]._bound_deployment
    engine_config = engine.init_args[0]
    assert engine_config == {"max_num_seqs": 4, "enable_prefix_caching": True}
    assert engine.num_replicas == 2
    assert engine.ray_actor_options["resources"] == {"neuron_cores": 2}
    with pytest.raises(ValueError, match="max_num_seq"):
        build_app({"max_num_seq": 4})
