"""Synthetic calibration numbers shared by the planner's tests (test_plan*.py): what
``hpcdl.plan.calibrate.measure`` returns, with round figures and a made-up CPU."""
from hpcdl.plan.layers import COMPUTE_CLASSES, OP_CLASSES

CLASS_RATES = {c: (3e10 if c in COMPUTE_CLASSES else 5e9) for c in OP_CLASSES}


def calibration_measurements(cpu=None):
    """A ``measure()`` result: 2 cores at 2.4 GHz x 32 FLOP/cycle, 10 GB/s per core, every
    compute class at 30 GFLOP/s per core and every memory pass at 5 GB/s."""
    return {"cores": 2, "cpu_mhz": 2400.0, "flops_per_cycle": 32,
            "flops_per_cycle_source": "flags", "matmul_flops_1_thread": 5e10,
            "matmul_flops_all_cores": 9e10, "stream_Bps_1_thread": 1e10,
            "stream_Bps_all_cores": 1.5e10, "class_batch": 8, "layer_overhead_s": 3e-5,
            "class_samples": [{"op_class": c, "work": r, "seconds": 1.0}
                              for c, r in CLASS_RATES.items()],
            "class_rates": dict(CLASS_RATES),
            "load_average_before": 1.0, "load_average_after": 1.5,
            "cpu": cpu or {"model_name": "Test CPU 9000", "capability": "AVX2",
                           "flags": ["avx2", "fma"]},
            "decode_images_per_s_1_thread": 400.0,
            "allreduce": {"alpha_s": 2e-6, "beta_s_per_byte": 2e-10, "intercept_s": 4e-6,
                          "slope_s_per_byte": 2.5e-10, "points": 6}}


def parameter_elements(model_name):
    """Each trainable parameter's elements of a registered model, from its shapes alone."""
    from hpcdl.plan.layers import meta_model
    from hpcdl.plan.workload import trainable_elements

    return trainable_elements(meta_model(model_name))
