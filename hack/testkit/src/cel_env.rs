//! CEL as Kubernetes evaluates it for DRA selectors and admission policies, on the `cel`
//! crate: the standard library, the strings and lists extensions, and the Kubernetes
//! `quantity` library (`quantity("80G")`, `compareTo`, `isGreaterThan`, `isLessThan`,
//! `asInteger`, `asApproximateFloat`, `isInteger`, `sign`; Kubernetes
//! `k8s.io/apiserver/pkg/cel/library/quantity.go`). Quantities are exact to the nano unit.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use cel::extractors::This;
use cel::objects::{Key, Map, Opaque};
use cel::{Context, Env, ExecutionError, Program, Value};

/// Why an expression could not be compiled or evaluated.
#[derive(Debug, thiserror::Error)]
pub enum CelError {
    /// The expression does not parse.
    #[error("CEL expression {expr:?} does not compile: {message}")]
    Compile { expr: String, message: String },
    /// Evaluation failed (a missing key, a type error, ...).
    #[error("CEL expression {expr:?} failed: {message}")]
    Runtime { expr: String, message: String },
    /// The expression gave something other than what the caller needs.
    #[error("CEL expression {expr:?} gave {got}, not a {want}")]
    Type {
        expr: String,
        got: String,
        want: &'static str,
    },
    /// A quantity string that Kubernetes would not accept.
    #[error("bad quantity {0:?}")]
    Quantity(String),
}

/// A Kubernetes resource quantity, in nano units (exact for every value cleave publishes).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Qty(pub i128);

const NANO: i128 = 1_000_000_000;

impl Qty {
    /// Parses a quantity string (`10Gi`, `1000M`, `0.5`, `500m`, `1e3`).
    pub fn parse(s: &str) -> Result<Qty, CelError> {
        let bad = || CelError::Quantity(s.to_owned());
        let t = s.trim();
        let (sign, t) = match t.strip_prefix('-') {
            Some(r) => (-1, r),
            None => (1, t.strip_prefix('+').unwrap_or(t)),
        };
        let end = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, suffix) = t.split_at(end);
        if num.is_empty() || num == "." {
            return Err(bad());
        }
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        if frac.len() > 9 {
            return Err(bad());
        }
        let int: i128 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| bad())?
        };
        let frac_n: i128 = if frac.is_empty() {
            0
        } else {
            format!("{frac:0<9}").parse().map_err(|_| bad())?
        };
        let base = int.checked_mul(NANO).ok_or_else(bad)? + frac_n;
        let scaled = |num: i128, den: i128| -> Result<i128, CelError> {
            let v = base.checked_mul(num).ok_or_else(bad)?;
            if v % den != 0 {
                // Below a nano unit: Kubernetes rounds up; no cleave value gets here.
                return Ok(v / den + 1);
            }
            Ok(v / den)
        };
        let pow = |b: i128, e: u32| b.pow(e);
        let v = match suffix {
            "" => base,
            "n" => scaled(1, NANO)?,
            "u" => scaled(1, 1_000_000)?,
            "m" => scaled(1, 1000)?,
            "k" => scaled(1000, 1)?,
            "M" => scaled(pow(1000, 2), 1)?,
            "G" => scaled(pow(1000, 3), 1)?,
            "T" => scaled(pow(1000, 4), 1)?,
            "P" => scaled(pow(1000, 5), 1)?,
            "E" => scaled(pow(1000, 6), 1)?,
            "Ki" => scaled(1 << 10, 1)?,
            "Mi" => scaled(1 << 20, 1)?,
            "Gi" => scaled(1 << 30, 1)?,
            "Ti" => scaled(1 << 40, 1)?,
            "Pi" => scaled(1 << 50, 1)?,
            "Ei" => scaled(1 << 60, 1)?,
            e if e.starts_with(['e', 'E']) => {
                let exp: i32 = e[1..].parse().map_err(|_| bad())?;
                if exp >= 0 {
                    scaled(10i128.checked_pow(exp.unsigned_abs()).ok_or_else(bad)?, 1)?
                } else {
                    scaled(1, 10i128.checked_pow(exp.unsigned_abs()).ok_or_else(bad)?)?
                }
            }
            _ => return Err(bad()),
        };
        Ok(Qty(sign * v))
    }

    /// A whole number of units (bytes, multiprocessors).
    pub fn units(n: i128) -> Qty {
        Qty(n * NANO)
    }

    /// The value rounded up to a whole unit, as `Quantity.Value()` does.
    pub fn ceil_units(self) -> i128 {
        self.0.div_euclid(NANO) + i128::from(self.0.rem_euclid(NANO) != 0)
    }

    /// The canonical-enough string: whole units plain, else milli or nano units.
    pub fn to_k8s(self) -> String {
        if self.0 % NANO == 0 {
            format!("{}", self.0 / NANO)
        } else if self.0 % 1_000_000 == 0 {
            format!("{}m", self.0 / 1_000_000)
        } else {
            format!("{}n", self.0)
        }
    }
}

impl fmt::Debug for Qty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Qty({})", self.to_k8s())
    }
}

impl Opaque for Qty {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Quantity"
    }
}

fn qty_of(v: &Arc<dyn Opaque>, function: &str) -> Result<Qty, ExecutionError> {
    v.downcast_ref::<Qty>()
        .copied()
        .ok_or_else(|| ExecutionError::function_error(function, "not a quantity"))
}

/// A quantity as a CEL value.
pub fn qty_value(q: Qty) -> Value {
    Value::Opaque(Arc::new(q))
}

/// The shared environment: standard library, strings and lists extensions.
pub fn env() -> Arc<Env> {
    let mut env = Env::stdlib();
    // Registered on a fresh environment, neither can collide.
    let _ = env.add_extension(cel::extensions::strings);
    let _ = env.add_extension(cel::extensions::lists);
    Arc::new(env)
}

/// A context over `env` with the quantity library.
pub fn context(env: &Arc<Env>) -> Context<'static, 'static> {
    let mut ctx = Context::with_env(env.clone());
    let _ = ctx.add_function(
        "quantity",
        |s: Arc<String>| -> Result<Value, ExecutionError> {
            Qty::parse(&s)
                .map(qty_value)
                .map_err(|e| ExecutionError::function_error("quantity", e))
        },
    );
    let _ = ctx.add_function(
        "compareTo",
        |This(a): This<Arc<dyn Opaque>>, b: Arc<dyn Opaque>| -> Result<i64, ExecutionError> {
            Ok(
                match qty_of(&a, "compareTo")?.cmp(&qty_of(&b, "compareTo")?) {
                    std::cmp::Ordering::Less => -1,
                    std::cmp::Ordering::Equal => 0,
                    std::cmp::Ordering::Greater => 1,
                },
            )
        },
    );
    let _ = ctx.add_function(
        "isGreaterThan",
        |This(a): This<Arc<dyn Opaque>>, b: Arc<dyn Opaque>| -> Result<bool, ExecutionError> {
            Ok(qty_of(&a, "isGreaterThan")? > qty_of(&b, "isGreaterThan")?)
        },
    );
    let _ = ctx.add_function(
        "isLessThan",
        |This(a): This<Arc<dyn Opaque>>, b: Arc<dyn Opaque>| -> Result<bool, ExecutionError> {
            Ok(qty_of(&a, "isLessThan")? < qty_of(&b, "isLessThan")?)
        },
    );
    let _ = ctx.add_function(
        "asInteger",
        |This(a): This<Arc<dyn Opaque>>| -> Result<i64, ExecutionError> {
            let q = qty_of(&a, "asInteger")?;
            if q.0 % NANO != 0 {
                return Err(ExecutionError::function_error(
                    "asInteger",
                    "not an integer",
                ));
            }
            i64::try_from(q.0 / NANO)
                .map_err(|_| ExecutionError::function_error("asInteger", "out of range"))
        },
    );
    let _ = ctx.add_function(
        "isInteger",
        |This(a): This<Arc<dyn Opaque>>| -> Result<bool, ExecutionError> {
            Ok(qty_of(&a, "isInteger")?.0 % NANO == 0)
        },
    );
    let _ = ctx.add_function(
        "asApproximateFloat",
        |This(a): This<Arc<dyn Opaque>>| -> Result<f64, ExecutionError> {
            #[allow(clippy::cast_precision_loss)]
            Ok(qty_of(&a, "asApproximateFloat")?.0 as f64 / 1e9)
        },
    );
    let _ = ctx.add_function(
        "sign",
        |This(a): This<Arc<dyn Opaque>>| -> Result<i64, ExecutionError> {
            Ok(qty_of(&a, "sign")?.0.signum() as i64)
        },
    );
    ctx
}

/// A JSON value as CEL sees an object: numbers that are integers become `int`.
pub fn json_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Value::Int(i),
            None => match n.as_u64() {
                Some(u) => Value::UInt(u),
                None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
        },
        serde_json::Value::String(s) => Value::String(Arc::new(s.clone())),
        serde_json::Value::Array(a) => Value::List(Arc::new(a.iter().map(json_value).collect())),
        serde_json::Value::Object(o) => map(o.iter().map(|(k, v)| (k.clone(), json_value(v)))),
    }
}

/// A CEL map with string keys.
pub fn map(entries: impl IntoIterator<Item = (String, Value)>) -> Value {
    let m: HashMap<Key, Value> = entries
        .into_iter()
        .map(|(k, v)| (Key::String(Arc::new(k)), v))
        .collect();
    Value::Map(Map { map: Arc::new(m) })
}

/// Compiled programs, each compiled once.
#[derive(Default)]
pub struct Programs {
    compiled: HashMap<String, Arc<Program>>,
}

impl Programs {
    /// The program of `expr`, compiled on first use.
    pub fn get(&mut self, env: &Env, expr: &str) -> Result<Arc<Program>, CelError> {
        if let Some(p) = self.compiled.get(expr) {
            return Ok(p.clone());
        }
        let p = Arc::new(env.compile(expr).map_err(|e| CelError::Compile {
            expr: expr.to_owned(),
            message: e.to_string(),
        })?);
        self.compiled.insert(expr.to_owned(), p.clone());
        Ok(p)
    }
}

/// Runs `program` (of `expr`) in `ctx`.
pub fn eval(program: &Program, ctx: &Context<'_, '_>, expr: &str) -> Result<Value, CelError> {
    program.execute(ctx).map_err(|e| CelError::Runtime {
        expr: expr.to_owned(),
        message: e.to_string(),
    })
}

/// Runs `program` and wants a bool.
pub fn eval_bool(program: &Program, ctx: &Context<'_, '_>, expr: &str) -> Result<bool, CelError> {
    match eval(program, ctx, expr)? {
        Value::Bool(b) => Ok(b),
        other => Err(CelError::Type {
            expr: expr.to_owned(),
            got: format!("{other:?}"),
            want: "bool",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(expr: &str) -> Value {
        let env = env();
        let ctx = context(&env);
        env.compile(expr).unwrap().execute(&ctx).unwrap()
    }

    #[test]
    fn quantities_parse_like_kubernetes() {
        assert_eq!(Qty::parse("10Gi").unwrap(), Qty::units(10 << 30));
        assert_eq!(Qty::parse("80G").unwrap(), Qty::units(80_000_000_000));
        assert_eq!(Qty::parse("0.5").unwrap(), Qty(NANO / 2));
        assert_eq!(Qty::parse("500m").unwrap(), Qty(NANO / 2));
        assert_eq!(Qty::parse("1e3").unwrap(), Qty::units(1000));
        assert_eq!(Qty::parse("10.5Gi").unwrap(), Qty::units(10752 << 20));
        assert!(Qty::parse("ten").is_err());
        assert!(Qty::parse("1Xi").is_err());
        assert_eq!(Qty::parse("1.5").unwrap().ceil_units(), 2);
        assert_eq!(Qty::units(4096).to_k8s(), "4096");
    }

    #[test]
    fn the_quantity_library_compares() {
        assert_eq!(
            run("quantity('81559Mi').compareTo(quantity('80G'))"),
            Value::Int(1)
        );
        assert_eq!(
            run("quantity('1Gi').isLessThan(quantity('1G'))"),
            Value::Bool(false)
        );
        assert_eq!(run("quantity('1.5').isInteger()"), Value::Bool(false));
        assert_eq!(run("quantity('2k').asInteger()"), Value::Int(2000));
        assert_eq!(
            run("quantity('1Gi') == quantity('1024Mi')"),
            Value::Bool(true)
        );
    }

    #[test]
    fn strings_and_lists_extensions_are_there() {
        assert_eq!(run("['a', 'b'].join(', ')"), Value::from("a, b"));
        assert_eq!(run("'H100 80GB'.matches('H100')"), Value::Bool(true));
        assert_eq!(
            run("has({'a': 1}.a) && !has({'a': 1}.b)"),
            Value::Bool(true)
        );
    }
}
