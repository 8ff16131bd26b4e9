//! Walking any Burn module's float parameters by dotted path: listing them, emptying them,
//! loading a subset, and reading their gradients. Paths are the only key (`ParamId` is random
//! per process and per run). Nothing here knows which model it walks.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Gradients, Tensor};

/// Tracks the dotted path through `enter_module`/`exit_module` (Burn never calls the
/// `*_with_path` visitor hooks from `Module::visit`).
#[derive(Debug, Default)]
struct Path(Vec<String>);

impl Path {
    fn join(&self) -> String {
        self.0.join(".")
    }
}

/// Every float parameter's path and shape, in visit order.
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
                .push((self.path.join(), param.val().dims().to_vec()));
        }
    }
    let mut v = Shapes::default();
    module.visit(&mut v);
    v.out
}

/// Every float parameter's values as f32, flattened row-major, by path.
pub fn param_values<M: Module>(module: &M) -> HashMap<String, Vec<f32>> {
    #[derive(Debug, Default)]
    struct Values {
        path: Path,
        out: HashMap<String, Vec<f32>>,
    }
    impl ModuleVisitor for Values {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let values = param
                .val()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap_or_default();
            self.out.insert(self.path.join(), values);
        }
    }
    let mut v = Values::default();
    module.visit(&mut v);
    v.out
}

/// Sets the parameters named in `values` (flat, reshaped to the parameter's rank by `shapes`)
/// and empties every other one: `empty_rest` replaces them by zero-element tensors, which is
/// how released parameters cost no memory. With `require_grad` the loaded values become
/// autodiff leaves (pass values on an autodiff device). Values keep the parameter's id.
pub fn load<M: Module>(
    module: M,
    values: &mut HashMap<String, Tensor<1>>,
    shapes: &HashMap<String, Vec<usize>>,
    empty_rest: bool,
    require_grad: bool,
) -> M {
    struct Loader<'a> {
        path: Path,
        values: &'a mut HashMap<String, Tensor<1>>,
        shapes: &'a HashMap<String, Vec<usize>>,
        empty_rest: bool,
        require_grad: bool,
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
            let (id, old, mapper) = param.consume();
            let value = match self.values.remove(&name) {
                Some(flat) => {
                    let shape: [usize; D] = self.shapes[&name]
                        .as_slice()
                        .try_into()
                        .expect("a parameter's rank never changes");
                    // Reshape first: the leaf must be the tensor the module holds.
                    let v = flat.reshape(shape);
                    if self.require_grad {
                        v.require_grad()
                    } else {
                        v
                    }
                }
                None if self.empty_rest => Tensor::empty([0; D], &old.device()),
                None => old,
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    module.map(&mut Loader {
        path: Path::default(),
        values,
        shapes,
        empty_rest,
        require_grad,
    })
}

/// The gradients of the parameters named in `wanted`, flattened, by path.
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
            if let Some(&numel) = self.wanted.get(&name)
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

/// Every float parameter of `module` replaced by rank 0's value (FSDP's `sync_module_states`):
/// Burn initialises parameters per process, so replicas built independently differ. Every
/// rank must call it with a module of the same structure; one broadcast per parameter.
pub fn sync_from_rank0<M: Module>(
    comm: &ember_comm::Comm,
    module: M,
) -> Result<M, crate::error::ShardError> {
    let shapes = param_shapes(&module);
    let mut values = param_values(&module);
    let device = {
        #[derive(Default)]
        struct First(Option<burn::tensor::Device>);
        impl ModuleVisitor for First {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.0.is_none() {
                    self.0 = Some(param.val().device());
                }
            }
        }
        let mut f = First::default();
        module.visit(&mut f);
        match f.0 {
            Some(d) => d,
            None => return Ok(module),
        }
    };
    let mut tensors = HashMap::new();
    for (name, shape) in &shapes {
        let mut v = values.remove(name).unwrap_or_default();
        comm.world().broadcast(&mut v, 0)?;
        let n = v.len();
        tensors.insert(
            name.clone(),
            Tensor::<1>::from_data(burn::tensor::TensorData::new(v, [n]), &device),
        );
        debug_assert_eq!(n, shape.iter().product::<usize>());
    }
    let shapes: HashMap<String, Vec<usize>> = shapes.into_iter().collect();
    Ok(load(module, &mut tensors, &shapes, false, false))
}
