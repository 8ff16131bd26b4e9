//! Every CubeCL kernel of the model defined ahead of a device ([`Ahead`]), for compiling them
//! where the device is not (`ember selftest --ptx`).

use std::sync::Arc;

use cubecl::CubeKernel;
use cubecl::ir::{DeviceProperties, TargetProperties};

use super::cube::Ahead;

/// Every CubeCL kernel of the model (attention, cross-entropy, bias and GELU, LayerNorm), in f32
/// and bf16, as a gpt2 step launches it, defined for a device with `device` and `target`
/// properties without a client: for compiling them where the device is not.
pub fn ahead(
    device: Arc<DeviceProperties>,
    target: Arc<TargetProperties>,
) -> Vec<(String, Box<dyn CubeKernel>)> {
    let mut ahead = Ahead {
        device,
        target,
        kernels: Vec::new(),
    };
    super::flash::ahead(&mut ahead);
    super::attention_products::ahead(&mut ahead);
    super::cube_cross_entropy::ahead(&mut ahead);
    super::cube_gelu::ahead(&mut ahead);
    super::cube_layer_norm::ahead(&mut ahead);
    ahead.kernels
}
