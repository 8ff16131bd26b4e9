//! Model tests: shapes, causality, Hugging Face names and counts, deterministic init, and
//! gradients against central finite differences in f64.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Gradients;
use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use ember_model::{Gpt, GptConfig, Tokens};
use ember_sharding::params::{grads_of, load, named_values, param_shapes};

fn tokens(model: &Gpt, values: Vec<i64>, b: usize, device: &Device) -> Tokens {
    model.tokens(values, b, device).unwrap()
}

fn to_vec(t: Tensor<3>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

#[test]
fn logits_have_batch_time_vocab_shape() {
    let device = Device::flex();
    let config = GptConfig::tiny();
    let model = config.init(&device).unwrap();
    let idx = tokens(&model, (0..2 * 10).map(|i| i % 50).collect(), 2, &device);
    assert_eq!(model.forward(&idx, None).dims(), [2, 10, config.vocab_size]);
}

#[test]
fn changing_a_later_token_never_changes_earlier_logits() {
    let device = Device::flex();
    let config = GptConfig::tiny();
    let model = config.init_with_seed(3, &device).unwrap();
    let t = 16;
    let base: Vec<i64> = (0..t as i64).map(|i| (i * 7) % 500).collect();
    let reference = to_vec(model.forward(&tokens(&model, base.clone(), 1, &device), None));
    let v = config.vocab_size;
    for changed in [1, 8, t - 1] {
        let mut other = base.clone();
        other[changed] = (other[changed] + 123) % 500;
        let logits = to_vec(model.forward(&tokens(&model, other, 1, &device), None));
        // Positions before `changed` see only unchanged tokens: identical logits.
        assert_eq!(
            &logits[..changed * v],
            &reference[..changed * v],
            "t+1 = {changed}"
        );
        // The changed position itself must move, or this test proves nothing.
        assert_ne!(&logits[changed * v..], &reference[changed * v..]);
    }
}

/// GPT-2's Hugging Face names for `n_layer` blocks, minus the `transformer.` prefix.
fn hf_names(n_layer: usize) -> Vec<String> {
    let mut names = vec!["wte.weight".to_string(), "wpe.weight".to_string()];
    for i in 0..n_layer {
        for p in [
            "ln_1.weight",
            "ln_1.bias",
            "attn.c_attn.weight",
            "attn.c_attn.bias",
            "attn.c_proj.weight",
            "attn.c_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
            "mlp.c_proj.bias",
        ] {
            names.push(format!("h.{i}.{p}"));
        }
    }
    names.extend(["ln_f.weight".to_string(), "ln_f.bias".to_string()]);
    names
}

#[test]
fn parameters_are_named_and_shaped_as_hugging_face_gpt2() {
    let device = Device::flex();
    let config = GptConfig::new(3, 4, 32, 16, 100);
    let named = param_shapes(&config.init(&device).unwrap());
    let names: Vec<_> = named.iter().map(|n| n.0.clone()).collect();
    assert_eq!(names, hf_names(3));
    let shape = |n: &str| named.iter().find(|t| t.0 == n).unwrap().1.clone();
    assert_eq!(shape("wte.weight"), [100, 32]);
    assert_eq!(shape("wpe.weight"), [16, 32]);
    assert_eq!(shape("h.2.attn.c_attn.weight"), [32, 96]); // Conv1D layout [in, out]
    assert_eq!(shape("h.0.mlp.c_fc.weight"), [32, 128]);
    assert_eq!(shape("h.0.mlp.c_proj.weight"), [128, 32]);
    let count: usize = named.iter().map(|n| n.1.iter().product::<usize>()).sum();
    assert_eq!(count as u64, config.num_params());
}

#[test]
fn init_is_a_function_of_the_seed() {
    let device = Device::flex();
    let config = GptConfig::tiny();
    let flat = |seed| -> Vec<f32> {
        named_values(&config.init_with_seed(seed, &device).unwrap())
            .into_iter()
            .flat_map(|(_, _, v)| v.into_data().try_to_vec::<f32>().unwrap())
            .collect()
    };
    assert_eq!(flat(5), flat(5));
    assert_ne!(flat(5), flat(6));
}

/// Casts every float parameter, keeping it trainable.
struct Cast(DType);

impl ModuleMapper for Cast {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|t| t.cast(dtype).detach().require_grad())
    }
}

#[test]
fn gradients_match_central_finite_differences_in_f64() {
    let device = Device::flex().autodiff();
    let config = GptConfig::tiny();
    let model = config
        .init_with_seed(11, &device)
        .unwrap()
        .map(&mut Cast(DType::F64));
    let (b, t) = (2, 12);
    let idx: Vec<i64> = (0..(b * t) as i64).map(|i| (i * 37 + 5) % 512).collect();
    let tgt: Vec<i64> = (0..(b * t) as i64).map(|i| (i * 11 + 3) % 512).collect();
    let loss_of = |m: &ember_model::Gpt| -> f64 {
        let loss = m
            .forward_loss(
                &tokens(m, idx.clone(), b, &device),
                &tokens(m, tgt.clone(), b, &device),
                None,
            )
            .1;
        loss.into_data().try_to_vec::<f64>().unwrap()[0]
    };

    let loss = model
        .forward_loss(
            &tokens(&model, idx.clone(), b, &device),
            &tokens(&model, tgt.clone(), b, &device),
            None,
        )
        .1;
    let grads = loss.backward();
    let named = named_values(&model);
    let shapes: HashMap<String, Vec<usize>> = param_shapes(&model).into_iter().collect();
    let checked = [
        // Rows 5 and 42 are input tokens: their gradient flows through the embedding and
        // the tied head, not through the head alone.
        ("wte.weight", vec![5 * 64 + 3, 42 * 64]),
        ("wpe.weight", vec![0, 11 * 64 + 63]),
        ("h.0.ln_1.weight", vec![7]),
        ("h.0.attn.c_attn.weight", vec![0, 64 * 192 - 1, 1000]),
        ("h.1.attn.c_proj.bias", vec![17]),
        ("h.1.mlp.c_fc.weight", vec![4242]),
        ("h.1.mlp.c_proj.weight", vec![99]),
        ("ln_f.bias", vec![63]),
    ];
    let h = 1e-6;
    for (name, elements) in checked {
        let entry = named.iter().find(|n| n.0 == name).unwrap();
        let grad = model_grad(&model, name, &entry.1, &grads);
        for e in elements {
            let mut values: Vec<f64> = entry.2.to_data().try_to_vec::<f64>().unwrap();
            let original = values[e];
            let mut at = |x: f64| {
                values[e] = x;
                let mut map: HashMap<String, Tensor<1>> = named
                    .iter()
                    .map(|n| (n.0.clone(), n.2.clone().detach()))
                    .collect();
                map.insert(
                    name.to_string(),
                    Tensor::from_data(
                        TensorData::new(values.clone(), [values.len()]),
                        TensorCreationOptions::new(device.clone()).with_dtype(DType::F64),
                    ),
                );
                loss_of(&load(model.clone(), &mut map, &shapes, &device, false))
            };
            let numeric = (at(original + h) - at(original - h)) / (2.0 * h);
            let analytic = grad[e];
            let tol = 1e-6 + 1e-4 * analytic.abs().max(numeric.abs());
            assert!(
                (numeric - analytic).abs() <= tol,
                "{name}[{e}]: analytic {analytic:e} vs numeric {numeric:e}"
            );
        }
    }
}

fn model_grad(
    model: &ember_model::Gpt,
    name: &str,
    shape: &[usize],
    grads: &Gradients,
) -> Vec<f64> {
    let wanted = HashMap::from([(name.to_string(), shape.iter().product())]);
    grads_of(model, grads, &wanted)
        .remove(name)
        .unwrap_or_else(|| panic!("no gradient reached {name}"))
        .into_data()
        .try_to_vec::<f64>()
        .unwrap()
}
