//! Python source checks behind the `ast_validation_passed` and `linter_passed` invariants
//! (seed 002): a tool argument that carries Python code must parse as Python 3 (the grammar of
//! CPython's `ast` module, through `rustpython-parser`), and may further be held to a fixed set
//! of deterministic lint rules.
//!
//! The lint rules read the token stream and the physical lines, never the tree, so they cannot
//! recurse. Parsing can: the parser and the tree it builds nest as deep as the source does
//! (`- - - … x` is one level per byte), so a parse runs on a stack sized from the source length:
//! a small source in place (on a fresh stack segment when the current one is short), a large one
//! on a thread of its own, at most one per core at a time. No input can overflow a stack or
//! hold an async worker for long.

use std::sync::{Arc, LazyLock};

use rustpython_parser::lexer::{LexResult, lex};
use rustpython_parser::{Mode, Parse, Tok, ast};
use tokio::sync::Semaphore;

/// The lint rules: code, what it flags. Codes follow pycodestyle, Pyflakes, Bandit and
/// flake8-debugger, so a finding reads the same as in those tools.
pub const RULES: &[(&str, &str)] = &[
    ("E501", "line too long"),
    ("E711", "comparison to None with == or !="),
    ("E712", "comparison to True or False with == or !="),
    ("E722", "bare `except:`"),
    ("F403", "wildcard import"),
    ("F632", "`is` comparison with a literal"),
    ("S102", "use of exec()"),
    ("S307", "use of eval()"),
    ("T100", "debugger call or import"),
    ("W191", "indentation contains tabs"),
    ("W291", "trailing whitespace"),
];

/// One problem, at a 1-based line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub line: usize,
    pub code: &'static str,
    pub message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {} {}", self.line, self.code, self.message)
    }
}

/// Which lint rules apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lint {
    /// Rule codes; empty = every rule.
    pub select: Vec<String>,
    pub max_line_length: usize,
}

impl Lint {
    fn on(&self, code: &str) -> bool {
        self.select.is_empty() || self.select.iter().any(|s| s == code)
    }
}

/// Refuses a rule code that [`RULES`] does not know.
pub fn check_select(select: &[String]) -> Result<(), String> {
    match select.iter().find(|s| !RULES.iter().any(|(c, _)| c == s)) {
        Some(bad) => Err(format!(
            "unknown lint rule '{bad}' (known: {})",
            RULES.iter().map(|(c, _)| *c).collect::<Vec<_>>().join(", ")
        )),
        None => Ok(()),
    }
}

/// Byte offsets where each line starts.
struct Lines(Vec<usize>);

impl Lines {
    fn new(src: &str) -> Lines {
        Lines(std::iter::once(0).chain(src.match_indices('\n').map(|(i, _)| i + 1)).collect())
    }

    fn line_of(&self, offset: usize) -> usize {
        self.0.partition_point(|&start| start <= offset).max(1)
    }
}

/// The syntax error of `src`, if it does not parse. Recurses as deep as the source nests: call
/// it on a thread with a large enough stack (as [`analyze`] does).
pub fn syntax_error(src: &str) -> Option<Finding> {
    let err = ast::Suite::parse(src, "<argument>").err()?;
    let line = Lines::new(src).line_of(usize::from(err.offset));
    Some(Finding { line, code: "E999", message: format!("syntax error: {}", err.error) })
}

fn is_literal(t: &Tok) -> bool {
    matches!(t, Tok::Int { .. } | Tok::Float { .. } | Tok::Complex { .. } | Tok::String { .. })
}

fn name(t: &Tok) -> Option<&str> {
    match t {
        Tok::Name { name } => Some(name),
        _ => None,
    }
}

/// The lint findings of source that parses (see [`syntax_error`]), in line order.
pub fn lint(src: &str, rules: &Lint) -> Vec<Finding> {
    let lines = Lines::new(src);
    let mut out = Vec::new();
    let tokens: Vec<(Tok, usize, usize)> = lex(src, Mode::Module)
        .filter_map(|t: LexResult| t.ok())
        .map(|(t, r)| (t, usize::from(r.start()), usize::from(r.end())))
        .collect();
    let at = |i: usize| tokens.get(i).map(|t| &t.0);
    let mut push = |offset: usize, code: &'static str, message: String| {
        out.push(Finding { line: lines.line_of(offset), code, message })
    };
    for (i, (tok, start, _)) in tokens.iter().enumerate() {
        let prev = i.checked_sub(1).and_then(at);
        let next = at(i + 1);
        let call_of_builtin = next == Some(&Tok::Lpar) && !matches!(prev, Some(Tok::Dot | Tok::Def));
        match tok {
            Tok::EqEqual | Tok::NotEqual => {
                for side in [prev, next].into_iter().flatten() {
                    if *side == Tok::None && rules.on("E711") {
                        push(*start, "E711", "comparison to None: use `is None` / `is not None`".into());
                    }
                    if matches!(side, Tok::True | Tok::False) && rules.on("E712") {
                        push(*start, "E712", "comparison to True/False: use `is` or the value itself".into());
                    }
                }
            }
            Tok::Except if next == Some(&Tok::Colon) && rules.on("E722") => {
                push(*start, "E722", "bare `except:` (name the exceptions caught)".into());
            }
            Tok::Import if next == Some(&Tok::Star) && rules.on("F403") => {
                push(*start, "F403", "wildcard import `from … import *`".into());
            }
            Tok::Is => {
                let rhs = if next == Some(&Tok::Not) { at(i + 2) } else { next };
                if (rhs.is_some_and(is_literal) || prev.is_some_and(is_literal)) && rules.on("F632") {
                    push(*start, "F632", "`is` comparison with a literal (use ==)".into());
                }
            }
            Tok::Import | Tok::From => {
                if let Some(m @ ("pdb" | "ipdb" | "pudb")) = next.and_then(name)
                    && rules.on("T100")
                {
                    push(*start, "T100", format!("debugger module `{m}` imported"));
                }
            }
            Tok::Name { name } => match name.as_str() {
                "exec" if call_of_builtin && rules.on("S102") => {
                    push(*start, "S102", "use of exec()".into());
                }
                "eval" if call_of_builtin && rules.on("S307") => {
                    push(*start, "S307", "use of eval()".into());
                }
                "breakpoint" | "set_trace" if next == Some(&Tok::Lpar) && rules.on("T100") => {
                    push(*start, "T100", format!("debugger call `{name}()`"));
                }
                _ => {}
            },
            _ => {}
        }
    }
    // Lines inside a multi-line string are text, not indentation.
    let in_string: Vec<(usize, usize)> = tokens
        .iter()
        .filter(|(t, s, e)| matches!(t, Tok::String { .. }) && src[*s..*e].contains('\n'))
        .map(|(_, s, e)| (*s, *e))
        .collect();
    for &start in &lines.0 {
        let text = src[start..].split('\n').next().unwrap_or("").trim_end_matches('\r');
        let chars = text.chars().count();
        if chars > rules.max_line_length && rules.on("E501") {
            push(start, "E501", format!("line too long ({chars} > {} characters)", rules.max_line_length));
        }
        if text.ends_with([' ', '\t']) && rules.on("W291") {
            push(start, "W291", "trailing whitespace".into());
        }
        let indent = &text[..text.len() - text.trim_start_matches([' ', '\t']).len()];
        let quoted = in_string.iter().any(|&(s, e)| s < start && start < e);
        if indent.contains('\t') && !quoted && rules.on("W191") {
            push(start, "W191", "indentation contains tabs".into());
        }
    }
    out.sort_by_key(|f| f.line);
    out
}

/// Sources up to this size are checked in place (a parse of this much takes a few ms at
/// most); larger ones on a thread of their own, so they never hold an async worker long.
const INLINE_MAX: usize = 16 << 10;

/// Large parses run one per core at a time; the rest wait.
static PARSES: LazyLock<Arc<Semaphore>> =
    LazyLock::new(|| Arc::new(Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))));

/// Stack a check of `len` bytes may need. Measured: ~100 bytes per nesting level in release
/// builds, several times that in debug builds; a source nests at most one level per byte.
fn stack_for(len: usize) -> usize {
    (1 << 20) + len.saturating_mul(1024)
}

fn run(src: &str, rules: Option<&Lint>, parses: bool) -> Vec<Finding> {
    match if parses { None } else { syntax_error(src) } {
        Some(e) => vec![e],
        None => rules.map(|r| lint(src, r)).unwrap_or_default(),
    }
}

/// Checks `src`: its syntax error, or (with `rules`) its lint findings. Empty means it passed.
/// `parses`: the source is already known to parse (the syntax check is skipped).
pub async fn analyze(src: String, rules: Option<Lint>, parses: bool) -> Result<Vec<Finding>, String> {
    let stack = stack_for(src.len());
    if src.len() <= INLINE_MAX {
        // On this stack when enough of it is left, else on a fresh segment (`stacker`).
        return Ok(stacker::maybe_grow(stack, stack, || run(&src, rules.as_ref(), parses)));
    }
    // The permit lives with the thread: a caller that gives up does not free its slot early.
    let permit = PARSES.clone().acquire_owned().await.map_err(|e| e.to_string())?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    // The stack is reserved, and only touched as deep as the source nests.
    std::thread::Builder::new()
        .name("python-check".into())
        .stack_size(stack + (8 << 20))
        .spawn(move || {
            let _ = tx.send(run(&src, rules.as_ref(), parses));
            drop(permit);
        })
        .map_err(|e| format!("cannot start the Python check: {e}"))?;
    rx.await.map_err(|_| "the Python check failed".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Lint {
        Lint { select: vec![], max_line_length: 40 }
    }

    fn codes(src: &str) -> Vec<&'static str> {
        assert!(syntax_error(src).is_none(), "{src:?} should parse");
        lint(src, &all()).into_iter().map(|f| f.code).collect()
    }

    #[test]
    fn syntax_errors_name_their_line() {
        assert!(syntax_error("def f(x):\n    return x + 1\n").is_none());
        assert!(syntax_error("match p:\n    case [x, *_]:\n        pass\n").is_none());
        assert!(syntax_error("def f[T](x: T) -> T: return x\n").is_none());
        let e = syntax_error("x = 1\nprint 'hello'\n").expect("python 2 print is not python 3");
        assert_eq!((e.line, e.code), (2, "E999"));
        assert_eq!(syntax_error("x = 1\ny = 2\nz = (3,\n").map(|e| e.code), Some("E999"));
        assert!(syntax_error("  x = 1\n").is_some(), "unexpected indent");
    }

    #[test]
    fn each_rule_flags_what_it_should_and_nothing_else() {
        let clean = "import os\n\n\ndef f(x):\n    if x is None:\n        return os.sep\n    try:\n        \
                     return x == 1\n    except ValueError:\n        return obj.eval(x)\n";
        assert_eq!(codes(clean), Vec::<&str>::new());
        assert_eq!(codes("x = 1\nif x == None:\n    pass\n"), ["E711"]);
        assert_eq!(codes("if True != x:\n    pass\n"), ["E712"]);
        assert_eq!(codes("try:\n    pass\nexcept:\n    pass\n"), ["E722"]);
        assert_eq!(codes("from os import *\n"), ["F403"]);
        assert_eq!(codes("if x is not 'a':\n    pass\n"), ["F632"]);
        assert_eq!(codes("exec('x = 1')\n"), ["S102"]);
        assert_eq!(codes("y = eval(s)\n"), ["S307"]);
        assert_eq!(codes("import pdb\n"), ["T100"]);
        assert_eq!(codes("breakpoint()\n"), ["T100"]);
        assert_eq!(codes("x = 1 \n"), ["W291"]);
        assert_eq!(codes("if x:\n\tpass\n"), ["W191"]);
        assert_eq!(codes(&format!("x = '{}'\n", "a".repeat(40))), ["E501"]);
        assert_eq!(codes("s = '''\n\tindented text\n'''\n"), Vec::<&str>::new(), "text inside a string");
        assert_eq!(codes("s = 'eval(x) except: == None'\n"), Vec::<&str>::new(), "code inside a string");
        let only = Lint { select: vec!["S307".into()], max_line_length: 40 };
        let got: Vec<_> = lint("try:\n    eval(x)\nexcept:\n    pass\n", &only).into_iter().map(|f| f.line).collect();
        assert_eq!(got, [2]);
    }

    #[test]
    fn unknown_rule_codes_are_refused() {
        assert!(check_select(&["E722".into(), "T100".into()]).is_ok());
        let e = check_select(&["E7222".into()]).unwrap_err();
        assert!(e.contains("E7222") && e.contains("E722"), "{e}");
    }

    #[tokio::test]
    async fn pathological_nesting_is_answered_not_crashed() {
        for src in [
            format!("x = {}1\n", "-".repeat(INLINE_MAX - 10)),
            format!("x = {}1\n", "-".repeat(200_000)),
            format!("x = {}1\n", "not ".repeat(50_000)),
            format!("x = {}1{}\n", "[".repeat(50_000), "]".repeat(50_000)),
            format!("x = a{}\n", ".b".repeat(100_000)),
        ] {
            let found = analyze(src, Some(all()), false).await.expect("answered");
            assert!(found.iter().all(|f| f.code != "E999"), "deep but valid: {found:?}");
        }
        let found = analyze(format!("x = {}\n", "(".repeat(100_000)), None, false).await.expect("answered");
        assert_eq!(found.first().map(|f| f.code), Some("E999"));
    }
}
