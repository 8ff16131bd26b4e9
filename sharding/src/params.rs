//! Walking any Burn module's float parameters by dotted path (`h.0.attn.c_attn.weight`): their
//! shapes, their values, loading values into a module, and reading gradients. Paths are the
//! only key (`ParamId` is random per process and per run). This is the one walker of the
//! project; nothing here knows which model it walks. Only [`named_values`] reads a value:
//! shapes, loading and gradients leave a lazy parameter (Burn's `Param::uninitialized`, which
//! `LinearConfig::init` and friends produce) unmaterialised.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Gradients, Shape, Tensor};

/// Tracks the dotted path through `enter_module`/`exit_module` (Burn never calls the
/// `*_with_path` visitor hooks from `Module::visit`).
#[derive(Debug, Default)]
struct Path(Vec<String>);

impl Path {
    fn join(&self) -> String {
        self.0.join(".")
    }
}

/// Every float parameter's path and shape, in visit order. Reads `lazy_shape`, so a lazy
/// parameter is not initialised.
pub fn param_shapes<M: Module>(module: &M) -> Vec<(String, Vec<usize>)> {
    #[derive(Debug, Default)]
    struct Shapes {
        path: Path,
        out: Vec<(String, Vec<usize>)>,
    }
    impl ModuleVisitor for Shapes {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.out
                .push((self.path.join(), param.lazy_shape().to_vec()));
        }
    }
    let mut v = Shapes::default();
    module.visit(&mut v);
    v.out
}

/// Every float parameter's path, shape and values (flattened to `[numel]`), in visit order.
/// Reads every value: a lazy parameter is initialised by it.
pub fn named_values<M: Module>(module: &M) -> Vec<(String, Vec<usize>, Tensor<1>)> {
    #[derive(Debug, Default)]
    struct Values {
        path: Path,
        out: Vec<(String, Vec<usize>, Tensor<1>)>,
    }
    impl ModuleVisitor for Values {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let shape = value.dims().to_vec();
            let numel: usize = shape.iter().product();
            self.out
                .push((self.path.join(), shape, value.reshape([numel])));
        }
    }
    let mut v = Values::default();
    module.visit(&mut v);
    v.out
}

/// Parameter `name`'s values (flattened), materialising it alone, and the module with that
/// parameter replaced by a zero-element tensor; every other parameter is left as it was (a
/// lazy one stays unmaterialised). `None` when the module has no parameter `name`.
pub(crate) fn take_value<M: Module>(module: M, name: &str) -> (M, Option<Tensor<1>>) {
    struct Taker<'a> {
        path: Path,
        name: &'a str,
        out: Option<Tensor<1>>,
    }
    impl ModuleMapper for Taker<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if self.path.join() != self.name {
                return param;
            }
            let value = param.val();
            let numel = value.dims().iter().product::<usize>();
            let device = value.device();
            self.out = Some(value.reshape([numel]));
            Param::initialized(param.id, Tensor::empty([0; D], &device))
        }
    }
    let mut taker = Taker {
        path: Path::default(),
        name,
        out: None,
    };
    let module = module.map(&mut taker);
    (module, taker.out)
}

/// Sets the parameters named in `values` (flat, reshaped to the parameter's shape from
/// `shapes`) and replaces every other one by a zero-element tensor on `device`, which is how a
/// skeleton holds no parameter memory. A replaced parameter is never read, so a lazy one is
/// dropped without being initialised. With `require_grad` the loaded values become autodiff
/// leaves (pass values on an autodiff device). Every parameter keeps its id.
pub fn load<M: Module>(
    module: M,
    values: &mut HashMap<String, Tensor<1>>,
    shapes: &HashMap<String, Vec<usize>>,
    device: &Device,
    require_grad: bool,
) -> M {
    load_with(module, values, shapes, device, require_grad, None)
}

/// The paths of parameters read that were not loaded, in the order they were read: what a
/// unit's forward read of units it does not declare.
#[derive(Debug, Clone, Default)]
pub(crate) struct ReadLog(Arc<Mutex<Vec<String>>>);

impl ReadLog {
    /// The paths read so far.
    pub(crate) fn read(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// [`load`], except that every parameter not in `values` becomes a lazy one that, when read,
/// adds its path to `log` and gives zeros of its shape in `dtype` (so a forward that reads it
/// runs on to where the log is looked at, instead of failing on an empty tensor).
pub(crate) fn load_logged<M: Module>(
    module: M,
    values: &mut HashMap<String, Tensor<1>>,
    shapes: &HashMap<String, Vec<usize>>,
    device: &Device,
    require_grad: bool,
    dtype: DType,
    log: &ReadLog,
) -> M {
    load_with(
        module,
        values,
        shapes,
        device,
        require_grad,
        Some((log, dtype)),
    )
}

fn load_with<M: Module>(
    module: M,
    values: &mut HashMap<String, Tensor<1>>,
    shapes: &HashMap<String, Vec<usize>>,
    device: &Device,
    require_grad: bool,
    logged: Option<(&ReadLog, DType)>,
) -> M {
    struct Loader<'a> {
        path: Path,
        values: &'a mut HashMap<String, Tensor<1>>,
        shapes: &'a HashMap<String, Vec<usize>>,
        device: &'a Device,
        require_grad: bool,
        logged: Option<(&'a ReadLog, DType)>,
    }
    impl ModuleMapper for Loader<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let name = self.path.join();
            let shape = |name: &str| -> [usize; D] {
                self.shapes[name]
                    .as_slice()
                    .try_into()
                    .expect("a parameter's rank never changes")
            };
            let value = match (self.values.remove(&name), self.logged) {
                (Some(flat), _) => {
                    // Reshape first: the leaf must be the tensor the module holds.
                    let v = flat.reshape(shape(&name));
                    if self.require_grad {
                        v.require_grad()
                    } else {
                        v
                    }
                }
                (None, Some((log, dtype))) => {
                    let dims = shape(&name);
                    let log = log.clone();
                    return Param::uninitialized(
                        param.id,
                        move |device: &Device, _| {
                            log.0.lock().unwrap_or_else(|e| e.into_inner()).push(name);
                            Tensor::<D>::zeros(dims, device).cast(dtype)
                        },
                        self.device.clone(),
                        false,
                        Shape::from(dims.to_vec()),
                    );
                }
                (None, None) => Tensor::empty([0; D], self.device),
            };
            // `Param::consume` would initialise a lazy parameter only to drop its value: build
            // the replacement from the id alone.
            Param::initialized(param.id, value)
        }
    }
    module.map(&mut Loader {
        path: Path::default(),
        values,
        shapes,
        device,
        require_grad,
        logged,
    })
}

/// The gradients of the parameters named in `wanted` (path -> element count), flattened, by
/// path (absent where the backward pass did not reach a parameter).
pub fn grads_of<M: Module>(
    module: &M,
    grads: &Gradients,
    wanted: &HashMap<String, usize>,
) -> HashMap<String, Tensor<1>> {
    struct Grads<'a> {
        path: Path,
        grads: &'a Gradients,
        wanted: &'a HashMap<String, usize>,
        out: HashMap<String, Tensor<1>>,
    }
    impl ModuleVisitor for Grads<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let name = self.path.join();
            // Only loaded parameters are read: the others are empty, or lazy ones that must
            // stay unread (`load_logged`).
            if let Some(&numel) = self.wanted.get(&name)
                && param.is_initialized()
                && let Some(g) = param.val().grad(self.grads)
            {
                self.out.insert(name, g.reshape([numel]));
            }
        }
    }
    let mut v = Grads {
        path: Path::default(),
        grads,
        wanted,
        out: HashMap::new(),
    };
    module.visit(&mut v);
    v.out
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::LinearConfig;

    #[derive(Module, Debug)]
    struct Two {
        a: burn::nn::Linear,
        b: burn::nn::Linear,
    }

    #[test]
    fn shapes_and_loading_never_initialise_a_lazy_parameter() {
        let device = Device::flex();
        let m = Two {
            a: LinearConfig::new(3, 4).init(&device),
            b: LinearConfig::new(4, 2).init(&device),
        };
        assert!(!m.a.weight.is_initialized());
        let shapes = param_shapes(&m);
        assert_eq!(
            shapes,
            vec![
                ("a.weight".to_string(), vec![3, 4]),
                ("a.bias".to_string(), vec![4]),
                ("b.weight".to_string(), vec![4, 2]),
                ("b.bias".to_string(), vec![2]),
            ]
        );
        assert!(!m.a.weight.is_initialized() && !m.b.weight.is_initialized());
        let shape_map: HashMap<String, Vec<usize>> = shapes.into_iter().collect();
        let mut values = HashMap::from([(
            "b.bias".to_string(),
            Tensor::<1>::from_floats([1.0, 2.0], &device),
        )]);
        let loaded = load(m, &mut values, &shape_map, &device, false);
        assert_eq!(loaded.a.weight.val().dims(), [0, 0]);
        assert_eq!(
            loaded
                .b
                .bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .try_to_vec::<f32>(),
            Ok(vec![1.0, 2.0])
        );
    }
}
