//! Parameters of any Burn module by dotted path (`h.0.attn.c_attn.weight`), read out or
//! replaced in place. Paths, not `ParamId`s, are the stable key: `ParamId`s are random per
//! process and per run. Generic over the module; nothing GPT-specific lives here.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Gradients;
use burn::tensor::Tensor;

/// One float parameter, flattened.
#[derive(Debug, Clone)]
pub struct NamedTensor {
    /// Dotted module path.
    pub name: String,
    /// Logical shape.
    pub shape: Vec<usize>,
    /// The process-local id (use it to look gradients up, never to persist).
    pub id: ParamId,
    /// The values, flattened row-major: `[numel]`.
    pub value: Tensor<1>,
}

/// Tracks the dotted path through `enter_module`/`exit_module` (Burn never calls the
/// `*_with_path` visitor hooks from `Module::visit`).
#[derive(Default, Debug)]
struct PathStack(Vec<String>);

impl PathStack {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn join(&self) -> String {
        self.0.join(".")
    }
}

#[derive(Default, Debug)]
struct Collector {
    path: PathStack,
    out: Vec<NamedTensor>,
}

impl ModuleVisitor for Collector {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        let shape = value.dims().to_vec();
        let numel: usize = shape.iter().product();
        self.out.push(NamedTensor {
            name: self.path.join(),
            shape,
            id: param.id,
            value: value.reshape([numel]),
        });
    }
}

/// Every float parameter of `module` in visit order (the order of field declaration).
pub fn named_tensors<M: Module>(module: &M) -> Vec<NamedTensor> {
    let mut collector = Collector::default();
    module.visit(&mut collector);
    collector.out
}

struct GradCollector<'a> {
    path: PathStack,
    grads: &'a Gradients,
    out: Vec<(String, Option<Tensor<1>>)>,
}

impl ModuleVisitor for GradCollector<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let grad = param.val().grad(self.grads).map(|g| {
            let numel: usize = g.dims().iter().product();
            g.reshape([numel])
        });
        self.out.push((self.path.join(), grad));
    }
}

/// The gradient of every float parameter of `module` (flattened, `[numel]`, off the autodiff
/// graph) in visit order; `None` where the backward pass did not reach a parameter.
pub fn named_grads<M: Module>(module: &M, grads: &Gradients) -> Vec<(String, Option<Tensor<1>>)> {
    let mut collector = GradCollector {
        path: PathStack::default(),
        grads,
        out: Vec::new(),
    };
    module.visit(&mut collector);
    collector.out
}

struct Replacer {
    path: PathStack,
    values: HashMap<String, Tensor<1>>,
    errors: Vec<String>,
}

impl ModuleMapper for Replacer {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let name = self.path.join();
        let Some(new) = self.values.remove(&name) else {
            self.errors.push(format!("no value for parameter `{name}`"));
            return param;
        };
        if !param.is_initialized() {
            // A lazy parameter is replaced without drawing its initial values: trainable
            // wherever the device it was to be made on tracks gradients.
            let shape: [usize; D] = param.lazy_shape().dims();
            let numel: usize = shape.iter().product();
            if new.dims()[0] != numel {
                self.errors.push(format!(
                    "parameter `{name}` has shape {shape:?} ({numel} values) but {} were given",
                    new.dims()[0]
                ));
                return param;
            }
            let trainable = param.lazy_device().is_autodiff();
            let value = new.reshape(shape).detach().set_require_grad(trainable);
            return Param::initialized(param.id, value);
        }
        let (id, old, mapper) = param.consume();
        let shape: [usize; D] = old.dims();
        let numel: usize = shape.iter().product();
        if new.dims()[0] != numel {
            self.errors.push(format!(
                "parameter `{name}` has shape {shape:?} ({numel} values) but {} were given",
                new.dims()[0]
            ));
            return Param::from_mapped_value(id, old, mapper);
        }
        // Keep the id (optimizer state is keyed by it) and the trainable flag, which
        // `Param` would otherwise take from the new tensor.
        let value = new
            .reshape(shape)
            .detach()
            .set_require_grad(old.is_require_grad());
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Replaces every float parameter of `module` by the flattened value of the same name.
/// Fails, naming them, if a parameter has no value, a size differs, or a name is unused;
/// the module is returned unchanged only on success.
pub fn replace_named<M: Module>(
    module: M,
    values: HashMap<String, Tensor<1>>,
) -> Result<M, Vec<String>> {
    let mut replacer = Replacer {
        path: PathStack::default(),
        values,
        errors: Vec::new(),
    };
    let module = module.map(&mut replacer);
    let mut errors = replacer.errors;
    let mut unused: Vec<_> = replacer.values.into_keys().collect();
    unused.sort();
    errors.extend(
        unused
            .into_iter()
            .map(|n| format!("unknown parameter `{n}`")),
    );
    if errors.is_empty() {
        Ok(module)
    } else {
        Err(errors)
    }
}
