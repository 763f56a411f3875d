//! The one way a host function is registered: [`Imports`] and the `hostcall!` macro, which
//! take each import name once. The name both links the import and, for a hostcall refused
//! while `_initialize` runs (cpp-host's restricted callbacks), names it in the trap.

use wasmtime::{Caller, IntoFunc, Linker};

use crate::state::HostState;

/// The caller every hostcall gets.
pub(crate) type C<'a> = Caller<'a, HostState>;
/// What a proxy-wasm hostcall returns: an ABI status, or a trap.
pub(crate) type R = wasmtime::Result<i32>;

/// The linker and the import module (`env`, or one of the WASI names) being filled.
pub(crate) struct Imports<'l> {
    linker: &'l mut Linker<HostState>,
    module: &'l str,
}

impl<'l> Imports<'l> {
    pub(crate) fn new(linker: &'l mut Linker<HostState>, module: &'l str) -> Self {
        Imports { linker, module }
    }

    /// Links `module.name` to `f`.
    pub(crate) fn wrap<Params, Results>(
        &mut self,
        name: &str,
        f: impl IntoFunc<HostState, Params, Results>,
    ) -> wasmtime::Result<()> {
        self.linker.func_wrap(self.module, name, f)?;
        Ok(())
    }
}

/// Traps when a restricted hostcall runs during `_initialize` (only logging, clock, random
/// and environment calls are allowed then, as in cpp-host's `startVm`); counts the call.
pub(crate) fn guard(c: &mut C<'_>, name: &'static str) -> wasmtime::Result<()> {
    if c.data().restricted {
        wasmtime::bail!("restricted callback during _initialize: {name}");
    }
    let calls = &mut c.data_mut().hostcalls;
    // Every call site passes its own literal: the address identifies it.
    match calls.iter_mut().find(|(n, _)| std::ptr::eq(*n, name)) {
        Some((_, count)) => *count += 1,
        None => calls.push((name, 1)),
    }
    Ok(())
}

/// `hostcall!(imports, "name", |c, arg: i32, ...| body)` links a restricted hostcall
/// returning [`R`]: `c` is the mutable [`C`], and `name` is checked with [`guard`] first.
/// `hostcall!(imports, "name", always, |c, ...| -> T { ... })` links one allowed at any time,
/// with any return type; its first parameter is a pattern (`mut c`, `_`).
/// Expands to the `Result` of [`Imports::wrap`].
macro_rules! hostcall {
    ($imports:expr, $name:literal, always, |$c:pat_param $(, $arg:tt: $ty:ty)*| -> $ret:ty { $($body:tt)* }) => {
        $imports.wrap(
            $name,
            |$c: $crate::hostcalls::register::C<'_> $(, $arg: $ty)*| -> $ret { $($body)* },
        )
    };
    ($imports:expr, $name:literal, always, |$c:pat_param $(, $arg:tt: $ty:ty)*| $body:expr) => {
        $imports.wrap(
            $name,
            |$c: $crate::hostcalls::register::C<'_> $(, $arg: $ty)*| $body,
        )
    };
    ($imports:expr, $name:literal, |$c:ident $(, $arg:tt: $ty:ty)*| $body:expr) => {
        $imports.wrap(
            $name,
            |$c: $crate::hostcalls::register::C<'_> $(, $arg: $ty)*| -> $crate::hostcalls::register::R {
                #[allow(unused_mut)]
                let mut $c = $c;
                $crate::hostcalls::register::guard(&mut $c, $name)?;
                $body
            },
        )
    };
}
pub(crate) use hostcall;
